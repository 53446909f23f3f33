"""Context-parallel attention equals full causal attention (outputs and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mega_models.context_parallel import context_parallel_attention, zigzag_positions, zigzag_split
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device

# fp32 throughout; the ring merges partial softmaxes in a different order than one softmax,
# so results agree to the rounding bound of ``assert_close_to_reference`` with n the chain
# of sums behind one element: scores over d, softmax and values over s, forward and back.
B, HEADS, S, D = 2, 4, 16, 8
N = 2 * (D + 2 * S)


def _check_cp(method: str, groups: int, far: float = 0.0) -> None:
    """This rank's outputs and q/k/v gradients equal its zigzag share of the full ones.

    ``far``: q = far * e0 and k = -far * e0 for every token, so every score is the same
    -far^2/sqrt(d), far below zero: the attention is a plain mean over each causal prefix
    (computed without rounding noise from large scores), which a merge of partial softmaxes
    that stands in 0 for a masked block's max gets wrong once scores fall below about -88."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    dev = rank_device()
    b, n, s, d = B, HEADS, S, D
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
    assert_close_to_reference(out, zigzag_split(ref, cp, rank, dim=2), reduction_length=N,
                              name="output")  # fmt: skip
    # with ``far``, q's and k's gradients are far / sqrt(d) (= 7 at far 20) times sums of
    # p_ij (dO_i . v_j - D_i) that cancel exactly in exact arithmetic: the reference is ~0,
    # so the terms' scale is that factor times the largest dO_i . v_j, not max|reference|
    dov = grad_out @ v.repeat_interleave(groups, dim=1).transpose(-1, -2)  # [b, n, s, s]
    cancelled = far / d**0.5 * float(dov.abs().max()) if far else None
    for what, mine, full in zip("qkv", local, (ref_q, ref_k, ref_v), strict=True):
        assert mine.grad is not None and full.grad is not None
        assert_close_to_reference(
            mine.grad, zigzag_split(full.grad, cp, rank, dim=2), reduction_length=N,
            name=f"{method} cp {cp} rank {rank} far {far}: {what} grad", scale=cancelled if what != "v" else None,
        )  # fmt: skip


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
