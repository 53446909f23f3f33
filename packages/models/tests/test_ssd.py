"""The chunked SSD scan equals the sequential recurrence (outputs and gradients, fp64)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mega_models.hybrid_config import HybridConfig
from mega_models.hybrid_flops import ssd_flops_per_token
from mega_models.ssd import ssd_chunked, ssd_sequential
from mega_parallel_grid.testing import assert_close_to_reference

# fp64: the chunked form only reorders sums of O(1) terms over the steps (state-sized
# products each) and exponentiates sums of as many log-decays, so both forms agree to the
# rounding bound of ``assert_close_to_reference`` at fp64's u with n = 2 · L · (state + 1)
# (forward and back): ~1e-14 of the values, far below any real error (a wrong decay or mask).


def _n(length: int, state: int) -> int:
    return 2 * length * (state + 1)


def _inputs(
    length: int, b: int, h: int, p: int, g: int, n: int, seed: int = 0
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    x = torch.randn(length, b, h, p, generator=gen, dtype=f64)
    dt = torch.rand(length, b, h, generator=gen, dtype=f64) * 0.9 + 0.05  # steps in (0.05, 0.95)
    A = -(torch.rand(h, generator=gen, dtype=f64) * 3.0 + 0.1)  # decays in (-3.1, -0.1)
    B = torch.randn(length, b, g, n, generator=gen, dtype=f64)
    C = torch.randn(length, b, g, n, generator=gen, dtype=f64)
    return [t.requires_grad_() for t in (x, dt, A, B, C)]


@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 8, 23, 32])
@pytest.mark.parametrize(("h", "g"), [(4, 2), (3, 1), (4, 4)])
def test_chunked_matches_sequential(chunk: int, h: int, g: int) -> None:
    """Sequence 23 (prime): every chunk size but 1 and 23 pads the last chunk."""
    ref_in = _inputs(23, 2, h, 3, g, 5)
    mine_in = [t.detach().clone().requires_grad_() for t in ref_in]
    ref = ssd_sequential(*ref_in)
    out = ssd_chunked(*mine_in, chunk_size=chunk)
    assert_close_to_reference(out, ref, reduction_length=_n(23, 5), name="output")
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=ref.dtype)
    ref.backward(grad)
    out.backward(grad)
    for name, mine, full in zip("x dt A B C".split(), mine_in, ref_in, strict=True):
        assert mine.grad is not None and full.grad is not None
        assert_close_to_reference(mine.grad, full.grad, reduction_length=_n(23, 5), name=name)


def test_long_decay_keeps_precision() -> None:
    """Strong decays over many chunks: segment sums, not prefix-sum differences."""
    x, dt, A, B, C = (t.detach() for t in _inputs(64, 1, 2, 2, 1, 4, seed=3))
    dt = dt * 20.0  # log-decays down to -60 per step: exp of the prefix sums underflows
    ref = ssd_sequential(x, dt, A, B, C)
    for chunk in (4, 16):
        assert_close_to_reference(
            ssd_chunked(x, dt, A, B, C, chunk), ref, reduction_length=_n(64, 4), name=f"{chunk}"
        )


def test_fp32_close_to_fp64() -> None:
    """In fp32 the chunked scan stays within fp32 rounding of the fp64 recurrence."""
    x, dt, A, B, C = (t.detach() for t in _inputs(40, 2, 4, 8, 2, 16, seed=5))
    ref = ssd_sequential(x, dt, A, B, C)
    out = ssd_chunked(*(t.float() for t in (x, dt, A, B, C)), chunk_size=16)
    # outputs are sums of ~40 * 16 products of O(1) values: fp32's u applies
    assert_close_to_reference(out, ref, reduction_length=_n(40, 16), name="fp32 scan")


def test_flop_formula_matches_counted_matmuls() -> None:
    """ssd_flops_per_token counts exactly the matmuls ssd_chunked issues."""
    config = HybridConfig(hidden_size=32, mamba_head_dim=8, mamba_num_groups=2,
                          mamba_state_dim=4, mamba_chunk_size=4)  # fmt: skip
    length, b, h = 16, 2, config.mamba_num_heads
    x, dt, A, B, C = (t.detach().float() for t in _inputs(length, b, h, 8, 2, 4))
    with FlopCounterMode(display=False) as counter:
        ssd_chunked(x, dt, A, B, C, config.mamba_chunk_size)
    assert counter.get_total_flops() == ssd_flops_per_token(config, length) * length * b


def test_bad_shapes_raise_one_sentence() -> None:
    x, dt, A, B, C = (t.detach() for t in _inputs(8, 1, 4, 2, 2, 3))
    with pytest.raises(ValueError, match=r"SSD shapes do not fit") as info:
        ssd_chunked(x, dt[:, :, :3], A, B, C, 4)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"heads \(4\) are not divisible by groups \(3\)"):
        ssd_chunked(x, dt, A, B.repeat(1, 1, 2, 1)[:, :, :3], C.repeat(1, 1, 2, 1)[:, :, :3], 4)
    with pytest.raises(ValueError, match=r"chunk_size \(0\) must be a positive integer"):
        ssd_chunked(x, dt, A, B, C, 0)
