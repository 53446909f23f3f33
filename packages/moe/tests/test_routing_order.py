"""The routing's selection and ordering written without sorts equal the sorts they replace.

``row_topk``'s rounds of max against ``torch.topk`` (values and indices; ties to the lowest
index; rows with fewer finite entries than ``k``; NaN), eager and compiled; the permutation
``sort_by_expert`` builds by counting against two stable sorts (exact integers), eager and
compiled; and the routing of a group-limited router through the rounds equal to ``topk``'s.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from mega_moe._permute import sort_by_expert
from mega_moe.config import RouterConfig
from mega_moe.row_topk import ROUNDS_MAX_K, row_topk
from mega_moe.scores import select_experts
from mega_parallel_grid.testing import assert_close_to_reference


def _sorted_order(routing_map: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """What ``sort_by_expert`` computed until 2026-12-08: two stable sorts."""
    chosen = torch.argsort((~routing_map).to(torch.uint8), dim=1, stable=True)[:, :k]
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)
    return flat, order, torch.div(order, k, rounding_mode="floor")


def _routing_map(n: int, e: int, k: int, seed: int) -> Tensor:
    """``k`` distinct experts a token; where ``e > k`` expert 0 gets none and the first half
    of the tokens all go to experts 1..k (a skewed load)."""
    gen = torch.Generator().manual_seed(seed)
    low = 1 if e > k else 0
    index = low + torch.rand(n, e - low, generator=gen).argsort(dim=1)[:, :k]
    if n > 3:
        index[: n // 2] = torch.arange(low, low + k)
    return torch.zeros(n, e, dtype=torch.bool).scatter(1, index, True)


# (n, e, k, compiled): compiled on two of them (each compile costs seconds on 2 cores)
MAPS = [(1, 4, 1, False), (7, 8, 2, False), (33, 16, 4, True), (64, 64, 6, True),
        (5, 3, 3, False)]  # fmt: skip


@pytest.mark.parametrize(
    ("n", "e", "k", "compiled"), MAPS, ids=[f"{n}x{e}k{k}{'-compiled' * c}" for n, e, k, c in MAPS]
)
def test_counting_order_equals_the_stable_sorts(n: int, e: int, k: int, compiled: bool) -> None:
    routing_map = _routing_map(n, e, k, seed=n + e + k)
    assert bool((routing_map.sum(dim=1) == k).all())

    def build(m: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        perm, counts = sort_by_expert(m, per_token=k)
        assert perm.order is not None
        return perm.token_idx, perm.expert_idx, perm.order[0], perm.order[1], counts

    fn = torch.compile(build, backend="inductor", fullgraph=True) if compiled else build
    token_idx, expert_idx, order, inverse, counts = fn(routing_map)
    flat, want_order, want_tokens = _sorted_order(routing_map, k)
    assert torch.equal(order, want_order)
    assert torch.equal(token_idx, want_tokens)
    assert torch.equal(expert_idx, flat[want_order])
    assert torch.equal(inverse[order], torch.arange(n * k))
    assert torch.equal(counts, routing_map.sum(dim=0))
    pairs = routing_map.t().nonzero()  # the dropping path's order, expert-major
    assert torch.equal(torch.stack([expert_idx, token_idx], dim=1), pairs)


def _check_topk(x: Tensor, k: int, *, compiled: bool = False) -> tuple[Tensor, Tensor]:
    fn = torch.compile(row_topk, backend="inductor", fullgraph=True) if compiled else row_topk
    values, indices = fn(x, k, rounds=True)
    assert indices.shape == (*x.shape[:-1], k)
    distinct = indices.sort(dim=-1).values
    assert bool((distinct[..., 1:] != distinct[..., :-1]).all()), "an index taken twice"
    assert torch.equal(values, x.gather(-1, indices)) or bool(x.isnan().any())
    return values, indices


TOPK = [((40, 64), 6, True), ((40, 8, 8), 2, False), ((40, 8), 4, False), ((3, 5), 5, True)]


@pytest.mark.parametrize(("shape", "k", "compiled"), TOPK, ids=[f"{s}k{k}" for s, k, _ in TOPK])
def test_rounds_equal_topk(shape: tuple[int, ...], k: int, compiled: bool) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(k))  # no ties
    values, indices = _check_topk(x, k, compiled=compiled)
    want = torch.topk(x, k, dim=-1)
    assert torch.equal(values, want.values)
    assert torch.equal(indices, want.indices)


def test_rounds_break_ties_to_the_lowest_index() -> None:
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    values, indices = _check_topk(x, 4)
    assert indices.tolist() == [[1, 2, 4, 3], [0, 1, 2, 3]]
    assert torch.equal(values, torch.topk(x, 4, dim=-1).values)


def test_rounds_with_fewer_finite_entries_than_k() -> None:
    inf = float("inf")
    x = torch.tensor([[-inf, 2.0, -inf, -inf], [-inf, -inf, -inf, -inf]])
    values, indices = _check_topk(x, 3)
    assert indices.tolist() == [[1, 0, 2], [0, 1, 2]]
    assert values[0].tolist() == [2.0, -inf, -inf]


def test_rounds_rank_nan_first_as_topk_does() -> None:
    x = torch.tensor([[0.5, float("nan"), 2.0, 1.0]])
    values, indices = _check_topk(x, 2)
    assert indices.tolist() == [[1, 2]] == torch.topk(x, 2).indices.tolist()
    assert values[0, 0].isnan() and values[0, 1] == 2.0


def test_eager_takes_topk_and_bad_k_is_one_sentence() -> None:
    x = torch.randn(4, 8)
    assert torch.equal(row_topk(x, 3)[1], torch.topk(x, 3).indices)  # not compiling
    for k in (0, 9):
        with pytest.raises(ValueError, match=rf"row_topk: k \({k}\) must be in 1\.\.8"):
            row_topk(x, k)
    assert ROUNDS_MAX_K >= 8  # DeepSeek-V3's top 8


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_group_limited_routing_through_the_rounds(score: str) -> None:
    """``select_experts`` compiled (the rounds) equals it eager (``torch.topk``): the same
    experts, and weights that differ only by where Inductor rounds the softmax or the
    normalisation (a sum over the 16 experts at most, of terms at most 1)."""
    config = RouterConfig(
        num_experts=16, top_k=4, num_groups=4, group_topk=2, score_function=score,
        normalize_topk=True, group_score_topk=2,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(48, 16, generator=gen)
    bias = torch.randn(16, generator=gen) * 0.1
    eager = select_experts(logits, config, bias)
    compiled = torch.compile(select_experts, backend="inductor", fullgraph=True)(
        logits, config, bias
    )
    assert torch.equal(compiled[1], eager[1])
    assert_close_to_reference(
        compiled[0], eager[0], reduction_length=16, scale=1.0, name=f"{score} weights"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Inductor's GPU kernels)")
def test_on_cuda_at_a_real_size() -> None:
    """``deepseek-v3-3b``'s routing shapes on the GPU, compiled: 16,384 tokens, 8 groups of 8
    experts, the best 2 of each group, 4 groups, 6 experts; then the permutation."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16384, 64, device="cuda", generator=gen)
    top = torch.compile(row_topk, fullgraph=True)
    for shape, k in (((16384, 8, 8), 2), ((16384, 8), 4), ((16384, 64), 6)):
        values, indices = top(x.view(shape), k, rounds=True)
        want = torch.topk(x.view(shape), k, dim=-1)
        assert torch.equal(values, want.values) and torch.equal(indices, want.indices), shape
    routing_map = torch.zeros(16384, 64, dtype=torch.bool, device="cuda")
    routing_map.scatter_(1, torch.topk(x, 6, dim=-1).indices, True)

    def build(m: Tensor) -> tuple[Tensor, Tensor]:
        perm, _ = sort_by_expert(m, per_token=6)
        return perm.token_idx, perm.expert_idx

    token_idx, expert_idx = torch.compile(build, fullgraph=True)(routing_map)
    flat, order, tokens = _sorted_order(routing_map, 6)
    assert torch.equal(token_idx, tokens) and torch.equal(expert_idx, flat[order])
