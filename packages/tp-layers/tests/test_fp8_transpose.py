"""The opaque transposed copy of an fp8 tensor (``mega_tp_layers.fp8_transpose``).

A transposition moves bytes and computes nothing, so every check here is exact equality:
against ``x.t().contiguous()`` on the torch path, in the Triton kernel (interpreted on CPU
in a child process, compiled on CUDA), under ``torch.compile``, and as the fp8 GEMMs'
operand layout when it is swapped in for ``fp8_gemm.row_major`` / ``col_major``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import Tensor

import mega_tp_layers.fp8_gemm as fp8_gemm
from mega_parallel_grid.testing import run_kernel_child
from mega_tp_layers import Fp8Recipe
from mega_tp_layers.fp8 import fp8_linear_wgrad
from mega_tp_layers.fp8_transpose import col_major_by_kernel, row_major_by_kernel, transposed_copy

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
#: tiles partly outside the tensor, one element, exact tiles, a long thin one
SHAPES = [(1, 1), (70, 130), (64, 64), (128, 33), (3, 200)]


def _fp8(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 8).to(dtype)


def _bits(t: Tensor) -> Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}" for m, n in SHAPES])
def test_torch_path_equals_the_transpose(shape: tuple[int, int], dtype: torch.dtype) -> None:
    x = _fp8(shape, dtype, seed=1)
    got = transposed_copy(x)
    assert got.dtype == dtype and got.shape == (shape[1], shape[0]) and got.is_contiguous()
    assert torch.equal(_bits(got), _bits(x.t().contiguous()))


def check_kernel(device: str) -> list[str]:
    """Every shape x format through the kernel on ``device``; the failures, described."""
    failures = []
    for dtype in (*FP8, torch.uint8, torch.int8):
        for i, shape in enumerate([*SHAPES, (129, 257)]):
            x = _fp8(shape, torch.float32, seed=i).to(dtype).to(device)
            got = transposed_copy(x)
            if not torch.equal(_bits(got).cpu(), _bits(x.t().contiguous()).cpu()):
                failures.append(f"{dtype} {shape}")
    return failures


def test_triton_kernel() -> None:
    """The kernel in a child process: interpreted on CPU, compiled on CUDA."""
    pytest.importorskip("triton")
    cuda = torch.cuda.is_available()
    code = (
        "import json, runpy\n"
        "from mega_tp_layers.fp8_transpose import _kernel_applies\n"
        "import torch\n"
        f"dev = 'cuda' if {cuda} else 'cpu'\n"
        "assert _kernel_applies(torch.zeros(2, 2, dtype=torch.uint8, device=dev))\n"
        f"mod = runpy.run_path({__file__!r})\n"
        "print(json.dumps(mod['check_kernel'](dev)))\n"
    )
    stdout = run_kernel_child(code)
    assert json.loads(stdout.strip().splitlines()[-1]) == []


def test_compiled_keeps_the_copy_as_one_operator() -> None:
    """Under torch.compile the copy is an operator of its own in the graph (the producer
    cannot fuse it), and the compiled result equals eager, cast and all."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        graphs.append(gm)
        return gm

    def cast_then_transpose(x: Tensor, scale: Tensor) -> Tensor:
        return transposed_copy((x * scale).to(torch.float8_e4m3fn))

    x, scale = torch.randn(48, 80), torch.tensor(3.0)
    want = cast_then_transpose(x, scale)
    got = torch.compile(cast_then_transpose, backend=backend, fullgraph=True)(x, scale)
    assert torch.equal(_bits(got), _bits(want))
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.mega_tp_layers.transposed_copy.default in ops
    inductor = torch.compile(cast_then_transpose, backend="inductor", fullgraph=True)(x, scale)
    assert torch.equal(_bits(inductor), _bits(want))


@pytest.mark.parametrize("shape", [(16, 32), (48, 16)], ids=["16x32", "48x16"])
def test_layouts(shape: tuple[int, int]) -> None:
    """row_major_by_kernel / col_major_by_kernel give the layout ``_scaled_mm`` wants with
    the values unchanged, copying only when the layout differs."""
    x = _fp8(shape, torch.float8_e4m3fn, seed=5)
    for t in (x, x.t()):
        r, c = row_major_by_kernel(t), col_major_by_kernel(t)
        assert r.is_contiguous() and c.t().is_contiguous()
        assert torch.equal(_bits(r), _bits(t.contiguous()))
        assert torch.equal(_bits(c.contiguous()), _bits(t.contiguous()))
    assert row_major_by_kernel(x).data_ptr() == x.data_ptr()  # no copy when already so
    assert col_major_by_kernel(x.t()).data_ptr() == x.data_ptr()
    with pytest.raises(ValueError, match=r"^transposed_copy takes a 2-D tensor, got shape \(4,\)"):
        transposed_copy(torch.zeros(4, dtype=torch.uint8))


def test_wgrad_gets_the_same_operands(monkeypatch: pytest.MonkeyPatch) -> None:
    """The weight-gradient GEMM with the kernel's copies swapped in: ``torch._scaled_mm``
    (faked, as on a GPU) receives a row-major and a column-major operand holding the values
    the plain copies give, and the gradient is bit for bit the same."""
    seen: list[tuple[Tensor, Tensor]] = []

    def fake_scaled_mm(a: Tensor, b: Tensor, **kwargs: Any) -> Tensor:
        assert a.is_contiguous() and b.t().is_contiguous()
        seen.append((a, b))
        out = (a.float() @ b.float()) * (kwargs["scale_a"] * kwargs["scale_b"])
        return out.to(kwargs["out_dtype"])

    monkeypatch.setattr(fp8_gemm, "fp8_gemm_supported", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    recipe = Fp8Recipe(emulate=False)
    g = torch.Generator().manual_seed(7)
    dy, x = torch.randn(32, 48, generator=g), torch.randn(32, 16, generator=g)
    plain = fp8_linear_wgrad(dy, x, recipe)
    monkeypatch.setattr(fp8_gemm, "row_major", row_major_by_kernel)
    monkeypatch.setattr(fp8_gemm, "col_major", col_major_by_kernel)
    swapped = fp8_linear_wgrad(dy, x, recipe)
    assert torch.equal(swapped, plain)
    (a0, b0), (a1, b1) = seen
    assert torch.equal(_bits(a0), _bits(a1)) and torch.equal(_bits(b0), _bits(b1))
