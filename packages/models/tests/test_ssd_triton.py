"""The Triton SSD scan equals the sequential recurrence (outputs and the gradients of x, dt,
A, B, C and D) and, inside the Mamba-2 mixer, the torch scan.

The kernel cases run in one child process. Without a GPU it runs them in the Triton
interpreter (numpy, one program after another), which must be switched on before triton is
first imported (``TRITON_INTERPRET=1`` in the child's environment); with CUDA the same
cases run the compiled kernels on the GPU.

Tolerances as in ``test_ssd.py``: fp64 against the fp64 recurrence at the rounding bound
with n = 2 · L · (state + 1). The kernels take each in-chunk decay ``exp(s_i - s_j)`` as
the difference of two running sums of at most ``chunk`` log-decays (|s| < 25 here), which
adds a relative rounding of ~|s| · u, far inside the bound (~450 u at these sizes).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("triton")

from _child_cases import child_case_results
from test_ssd import _inputs as ssd_inputs

from mega_models.hybrid_config import HybridConfig
from mega_models.mamba import Mamba2Mixer
from mega_models.ssd import ssd_sequential
from mega_models.ssd_triton import ssd_triton
from mega_parallel_grid.testing import assert_close_to_reference, solo_groups

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(
    length: int, b: int, h: int, p: int, g: int, n: int, seed: int = 0
) -> list[torch.Tensor]:
    """``test_ssd``'s inputs (fp64, steps in (0.05, 0.95), decays in (-3.1, -0.1)) and ``D``."""
    D = torch.randn(h, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64)
    return [*ssd_inputs(length, b, h, p, g, n, seed), D.requires_grad_()]


def _check_against_sequential(
    shape: tuple[int, ...], chunk: int, with_d: bool, dtype: torch.dtype
) -> None:
    length, _, _, _, _, n = shape
    ref_in = _inputs(*shape)
    mine_in = [t.detach().to(DEVICE, dtype).requires_grad_() for t in ref_in]
    ref = ssd_sequential(*ref_in[:5])
    if with_d:
        ref = ref + ref_in[0] * ref_in[5][:, None]
    x, dt, A, B, C, D = mine_in
    out = ssd_triton(x, dt, A, B, C, chunk, D=D if with_d else None)
    assert out.dtype == dtype and out.shape == ref.shape
    chain = 2 * length * (n + 1)
    assert_close_to_reference(out, ref, reduction_length=chain, name="output")
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=ref.dtype)
    ref.backward(grad)
    out.backward(grad.to(DEVICE, dtype))
    names = "x dt A B C D".split()
    for name, mine, full in zip(names[: 5 + with_d], mine_in, ref_in, strict=False):
        assert mine.grad is not None and full.grad is not None
        assert_close_to_reference(mine.grad, full.grad, reduction_length=chain, name=name)
    if not with_d:
        assert D.grad is None


def _mixer_triton_equals_torch() -> None:
    config = HybridConfig(hidden_size=32, num_attention_heads=4, mamba_head_dim=8,
                          mamba_num_groups=2, mamba_state_dim=6, mamba_chunk_size=5)  # fmt: skip
    if not dist.is_initialized():  # the child process: a world of one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    tp = solo_groups().tp
    outs, grads = [], []
    for kernel in ("torch", "triton"):
        mixer = Mamba2Mixer(config.replace(ssd_kernel=kernel), tp_group=tp, seed=3,
                            dtype=torch.float64, device=DEVICE)  # fmt: skip
        gen = torch.Generator().manual_seed(4)
        x = torch.randn(12, 1, 32, generator=gen, dtype=torch.float64).to(DEVICE)
        x.requires_grad_()
        out = mixer(x)
        outs.append(out)
        grads.append(torch.autograd.grad(out, [x, *mixer.parameters()], torch.ones_like(out)))
    # the same model with the scan reordered: fp64 bound over the mixer's chain of sums
    chain = 2 * (32 + 4 + 12 * 7 + 2 * 64) + 12
    assert_close_to_reference(outs[1], outs[0], reduction_length=chain, name="mixer output")
    for i, (mine, ref) in enumerate(zip(grads[1], grads[0], strict=True)):
        assert_close_to_reference(mine, ref, reduction_length=chain, name=f"grad {i}")


#: the kernel cases, run in the child: shapes (l, b, h, p, g, n), chunk, D or none, dtype
CASES: dict[str, Callable[[], None]] = {
    "fp64, batch 2, 2 groups, last chunk padded": lambda: _check_against_sequential(
        (23, 2, 4, 8, 2, 16), 8, True, torch.float64
    ),
    "fp64, whole chunks, one group, no D": lambda: _check_against_sequential(
        (32, 1, 2, 16, 1, 16), 16, False, torch.float64
    ),
    "fp64, chunk 5 (not a power of two), a head per group": lambda: _check_against_sequential(
        (13, 1, 3, 4, 3, 8), 5, True, torch.float64
    ),
    # several blocks per chunk (the interpreter's are 16 steps) and four heads per group: the
    # causal blocks of the group's scores, the heads summed inside each block
    "fp64, chunk 40 over three blocks, 4 heads per group": lambda: _check_against_sequential(
        (50, 2, 8, 8, 2, 16), 40, True, torch.float64
    ),
    # fp32 inputs (accumulated in fp32) within fp32's bound of the fp64 recurrence
    "fp32 against the fp64 recurrence": lambda: _check_against_sequential(
        (20, 1, 2, 8, 1, 16), 8, True, torch.float32
    ),
    # half-precision operands, the bf16 path's casts (the interpreter's bf16 tl.dot is wrong:
    # numpy has no bf16), within fp16's bound
    "fp16 against the fp64 recurrence": lambda: _check_against_sequential(
        (20, 1, 2, 16, 1, 16), 8, True, torch.float16
    ),
    "mixer: triton scan == torch scan": _mixer_triton_equals_torch,
}


@pytest.fixture(scope="module")
def case_results() -> dict[str, str]:
    return child_case_results(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_kernels(case_results: dict[str, str], case: str) -> None:
    assert case_results[case] == "ok", case_results[case]


def test_bad_input_raises_one_sentence() -> None:
    x, dt, A, B, C, D = (t.detach() for t in _inputs(8, 1, 4, 2, 2, 3))
    with pytest.raises(ValueError, match=r"SSD shapes do not fit") as info:
        ssd_triton(x, dt[:, :, :3], A, B, C, 4)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"chunk_size \(0\) must be a positive integer"):
        ssd_triton(x, dt, A, B, C, 0)
    with pytest.raises(ValueError, match=r"D \(3,\) must have one value per head, like A \(4,\)"):
        ssd_triton(x, dt, A, B, C, 4, D=D[:3])


def test_config_names_the_kernel_choices() -> None:
    with pytest.raises(ValueError, match=r"ssd_kernel \('cuda'\) must be 'auto', 'triton' or"):
        HybridConfig(ssd_kernel="cuda")
