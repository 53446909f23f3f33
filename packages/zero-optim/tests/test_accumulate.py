"""``accumulate_grad`` (``main += alpha * grad`` into fp32) equals the exact sum to within its
own rounding, through ATen and through the Triton kernel (in the Triton interpreter on CPU,
in a child process with ``TRITON_INTERPRET=1``; compiled when CUDA is there).

Tolerance: the exact value ``main + alpha * grad`` (fp64; the inputs are exact in it) is
rounded to fp32 at most twice (the product, then the sum, or once by a fused multiply-add),
each rounding off by at most ``u = 2^-24`` of its result, so every element is within
``2u (|main| + |alpha * grad|)`` of it; a copy (``alpha = 1``, the step's first) is exact.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from mega_parallel_grid.testing import run_kernel_child
from mega_zero_optim import accumulate_grad

U32 = 2.0**-24
CASES = [  # (numel shape, grad dtype, alpha, first)
    ((4096,), torch.bfloat16, 1.0, False),
    ((3, 1000), torch.bfloat16, 1.0, True),
    ((5, 4099), torch.bfloat16, 0.37, False),
    ((7,), torch.float16, 0.37, True),
    ((2, 3, 700), torch.float32, 2.0, False),
]


def _check(
    shape: tuple[int, ...], dtype: torch.dtype, alpha: float, first: bool, device: str = "cpu"
) -> None:
    gen = torch.Generator().manual_seed(len(shape) * 31 + int(first))
    grad = torch.randn(shape, generator=gen).to(dtype)
    start = torch.randn(shape, generator=gen) * 3
    main = start.to(device, copy=True)
    accumulate_grad(main, grad.to(device), alpha=alpha, first=first)
    main = main.cpu()
    base = torch.zeros_like(start, dtype=torch.float64) if first else start.double()
    term = alpha * grad.double()
    exact = base + term
    bound = 2 * U32 * (base.abs() + term.abs())
    if first and alpha == 1.0:
        bound.zero_()  # a widening copy
    err = (main.double() - exact).abs()
    assert bool((err <= bound).all()), (
        f"{shape} {dtype} alpha {alpha} first {first}: worst error {float(err.max()):.3e} "
        f"over the bound by {float((err - bound).max()):.3e}"
    )


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_aten_path(case: tuple[tuple[int, ...], torch.dtype, float, bool]) -> None:
    """On CPU outside the interpreter the function takes ATen's ops."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter is on: the kernel runs here (the next test covers it)")
    _check(*case)


def test_triton_kernel() -> None:
    """The kernel in a child process: interpreted on CPU, compiled on CUDA."""
    pytest.importorskip("triton")
    cuda = torch.cuda.is_available()
    code = (
        "import json, torch, runpy\n"
        f"mod = runpy.run_path({__file__!r})\n"
        f"cuda = {cuda}\n"
        "from mega_zero_optim.accumulate import _kernel_applies\n"
        "out = {}\n"
        "for i, case in enumerate(mod['CASES']):\n"
        "    dev = 'cuda' if cuda else 'cpu'\n"
        "    probe = torch.zeros(2, device=dev)\n"
        "    assert _kernel_applies(probe, probe.bfloat16()), 'the kernel is not chosen'\n"
        "    try:\n"
        "        mod['_check'](*case, dev)\n"
        "        out[i] = 'ok'\n"
        "    except AssertionError as e:\n"
        "        out[i] = str(e)\n"
        "print(json.dumps(out))\n"
    )
    stdout = run_kernel_child(code)
    results = json.loads(stdout.strip().splitlines()[-1])
    assert results == {str(i): "ok" for i in range(len(CASES))}, results


def test_shape_mismatch_is_one_sentence() -> None:
    with pytest.raises(ValueError, match=r"main \(4,\) and grad \(5,\) must have the same shape"):
        accumulate_grad(torch.zeros(4), torch.zeros(5, dtype=torch.bfloat16))
