"""Context-parallel attention equals full causal attention (outputs and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mega_models.context_parallel import context_parallel_attention, zigzag_positions, zigzag_split
from mega_parallel_grid.testing import DistPool, rank_device

# fp32 throughout; the ring merges partial softmaxes in a different order than one softmax,
# so results agree to a few ulps of the values involved (|x| <= ~5): 1e-5 covers it.
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _check_cp(method: str, groups: int, far: float = 0.0) -> None:
    """This rank's outputs and q/k/v gradients equal its zigzag share of the full ones.

    ``far``: q = far * e0 and k = -far * e0 for every token, so every score is the same
    -far^2/sqrt(d), far below zero: the attention is a plain mean over each causal prefix
    (computed without rounding noise from large scores), which a merge of partial softmaxes
    that stands in 0 for a masked block's max gets wrong once scores fall below about -88."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    dev = rank_device()
    b, n, s, d = 2, 4, 16, 8
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, n, s, d, generator=gen)
    k = torch.randn(b, n // groups, s, d, generator=gen)
    v = torch.randn(b, n // groups, s, d, generator=gen)
    if far:
        e0 = torch.zeros(d)
        e0[0] = far
        q, k = e0.expand_as(q).clone(), (-e0).expand_as(k).clone()
    grad_out = torch.randn(b, n, s, d, generator=gen)
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, is_causal=True, enable_gqa=groups > 1)
    ref.backward(grad_out)

    local = [zigzag_split(t, cp, rank, dim=2).to(dev).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, cp_group=dist.group.WORLD, seq_len=s, method=method)  # type: ignore[arg-type]
    out.backward(zigzag_split(grad_out, cp, rank, dim=2).to(dev))
    torch.testing.assert_close(out.cpu(), zigzag_split(ref, cp, rank, dim=2).detach(), **TOL)
    # with ``far``, q's and k's gradients are far * scale (= 7 at far 20) times sums that
    # cancel exactly in exact arithmetic: their rounding grows by that factor
    grad_tol = {"rtol": 1e-5, "atol": 1e-5 * max(1.0, far)}
    for mine, full in zip(local, (ref_q, ref_k, ref_v), strict=True):
        assert mine.grad is not None and full.grad is not None
        torch.testing.assert_close(
            mine.grad.cpu(), zigzag_split(full.grad, cp, rank, dim=2), **grad_tol
        )


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("method", ["ring", "all_gather"])
@pytest.mark.parametrize("groups", [1, 2])
def test_cp_attention_matches_full(dist_pool: DistPool, cp: int, method: str, groups: int) -> None:
    dist_pool.run(_check_cp, cp, args=(method, groups))  # every rank checks its own share


@pytest.mark.parametrize("method", ["ring", "all_gather"])
def test_cp_attention_with_scores_far_below_zero(dist_pool: DistPool, method: str) -> None:
    dist_pool.run(_check_cp, 2, args=(method, 1, 20.0))  # every score -400/sqrt(8) = -141


def test_zigzag_positions_cover_sequence_once() -> None:
    positions = torch.cat([zigzag_positions(16, 4, r) for r in range(4)])
    assert sorted(positions.tolist()) == list(range(16))
    assert zigzag_positions(16, 4, 0).tolist() == [0, 1, 14, 15]
    with pytest.raises(ValueError, match=r"sequence length \(10\) is not divisible by 2\*cp \(4\)"):
        zigzag_positions(10, 2, 0)
