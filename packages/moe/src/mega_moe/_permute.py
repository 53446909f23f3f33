"""Permute tokens into expert-major order and back (weighted by the router's probabilities).

Token order inside one expert's block is ascending token index. A padded layout gives
every expert exactly ``capacity`` rows; empty slots point at a sentinel zero row ``N``.
An aligned layout (``sort_by_expert(..., align=16)``, for the FP8 experts' grouped GEMMs)
starts every expert's block at a multiple of 16 rows, the gaps and the last block's tail
pointing at the same sentinel (see :func:`mega_moe.fp8_rows.padded_rows`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mega_moe.fp8_rows import padded_rows

__all__ = ["Permutation", "capacity_slots", "chunk_permutation", "sort_by_expert"]


def _with_zero_row(x: Tensor) -> Tensor:
    """``[R, ...] -> [R + 1, ...]``: row R (the sentinel of padded layouts) is zero."""
    return torch.cat([x, x.new_zeros((1, *x.shape[1:]))])


class _PermuteRows(torch.autograd.Function):
    """``x.index_select(0, perm)`` for a permutation, whose backward gathers by the inverse.

    ``index_select``'s own backward is an ``index_add`` into zeros: atomic adds, slow in
    bf16 on the GPU; for a permutation the gather by its inverse is the same, exactly.
    ``padded``: ``x`` has rows that ``perm`` never picks (an aligned layout's gaps), whose
    ``inverse`` entries are the sentinel ``len(perm)``: their gradient is zero.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, perm: Tensor, inverse: Tensor, padded: bool = False) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.padded = padded
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (inverse,) = ctx.saved_tensors
        source = _with_zero_row(grad) if ctx.padded else grad
        return source.index_select(0, inverse), None, None, None


class _RepeatRows(torch.autograd.Function):
    """``[N, h] -> [N*k, h]``: row ``token_idx[i]`` of ``x`` at row ``i``, each row k times.

    ``inverse[token * k + choice]`` is the output row of that copy. The backward gathers
    the gradient back to token-major order by it and sums each token's k rows in fp32:
    no atomics (``index_select``'s backward would be an atomic ``index_add``), deterministic.
    ``padded``: an aligned layout, whose gap rows take the sentinel token ``N`` (zero).
    """

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, token_idx: Tensor, inverse: Tensor, k: int, padded: bool
    ) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return (_with_zero_row(x) if padded else x).index_select(0, token_idx)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        (inverse,) = ctx.saved_tensors
        per = grad.index_select(0, inverse).view(-1, ctx.k, grad.shape[-1])  # [N, k, h]
        return per.sum(dim=1, dtype=torch.float32).to(grad.dtype), None, None, None, None


class Permutation:
    """Where each row of the expert-major layout comes from, and its combine weight."""

    def __init__(
        self,
        token_idx: Tensor,
        expert_idx: Tensor,
        num_tokens: int,
        padded: bool,
        per_token: int | None = None,
        order: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        self.token_idx = token_idx  # [M] source token (N = the zero sentinel when padded)
        self.expert_idx = expert_idx  # [M] expert (column of the routing map) of each row
        self.num_tokens = num_tokens
        self.padded = padded
        self.per_token = per_token  # every token has exactly this many rows (no dropping)
        # with per_token, (expert_major, token_major): row i of the expert-major layout is
        # row expert_major[i] of the token-major one (token * k + choice), and row j of the
        # token-major layout is row token_major[j] of the expert-major one
        self.order = order

    def gather(self, x: Tensor) -> Tensor:
        """``[N, ...] -> [M, ...]``: the rows in expert-major order (zeros in empty slots)."""
        if self.per_token is not None and self.order is not None and x.dim() == 2:
            out: Tensor = _RepeatRows.apply(
                x, self.token_idx, self.order[1], self.per_token, self.padded
            )
            return out
        if self.padded:
            x = _with_zero_row(x)  # [N+1, ...], row N is zero
        return x.index_select(0, self.token_idx)

    def weights(self, probs: Tensor) -> Tensor:
        """The combine weight of each row, ``probs[token, expert]`` (0 in empty slots)."""
        if self.padded:
            probs = torch.cat([probs, probs.new_zeros((1, probs.shape[1]))])
        return probs[self.token_idx, self.expert_idx]  # [M]

    def scatter_add(self, y: Tensor, weights: Tensor) -> Tensor:
        """``[M, h] -> [N, h]``: sum each token's rows times their weights.

        With ``per_token`` rows per token: the rows permuted to token-major order (a
        gather both ways), then each token's k rows weighted and summed in fp32 — one fused
        reduction under ``torch.compile``, deterministic. (A batched GEMM
        ``[N, 1, k] x [N, k, h]`` ran as a k-wide, 2-aligned GEMM: ~1.3 ms per layer on an
        H200 at 16k tokens, k 2.) Otherwise an fp32 ``index_add``.
        """
        k = self.per_token
        if k is not None and self.order is not None:
            expert_major, token_major = self.order
            gaps = self.padded  # an aligned layout's gap rows carry no token
            rows: Tensor = _PermuteRows.apply(y, token_major, expert_major, gaps)
            per = rows.view(self.num_tokens, k, y.shape[-1])  # [N, k, h]
            row_w: Tensor = _PermuteRows.apply(weights.float(), token_major, expert_major, gaps)
            w = row_w.view(self.num_tokens, k, 1)
            acc = per[:, 0].float() * w[:, 0]
            for j in range(1, k):  # k small: one fused kernel compiled, k products eager
                acc = acc + per[:, j].float() * w[:, j]
            return acc.to(y.dtype)  # [N, h]
        total = self.num_tokens + (1 if self.padded else 0)
        out = torch.zeros((total, y.shape[-1]), dtype=torch.float32, device=y.device)
        out = out.index_add(0, self.token_idx, y.float() * weights.unsqueeze(-1))
        return out[: self.num_tokens].to(y.dtype)


def sort_by_expert(
    routing_map: Tensor, per_token: int | None = None, align: int = 1
) -> tuple[Permutation, Tensor]:
    """The kept (token, expert) pairs of ``routing_map [N, E]`` in expert-major order.

    ``per_token``: every row of the map holds exactly this many True (no dropping).
    ``align`` 16 (needs ``per_token``): every expert's block starts at a multiple of 16
    rows, as :func:`mega_moe.fp8_rows.padded_rows` lays them out (its static capacity).
    Returns the permutation and the per-expert row counts ``[E]`` (on the device; aligned:
    the blocks' sizes, gaps included, the last one taking the tail).
    """
    n = routing_map.shape[0]
    counts = routing_map.sum(dim=0)
    if per_token is not None:
        # exactly k experts per token: M = N*k rows, a static shape (no host sync, no
        # graph break under torch.compile), by counting instead of sorting
        flat, order, inverse = _counting_order(routing_map, per_token, counts)
        token_idx = torch.div(order, per_token, rounding_mode="floor")
        if align > 1:
            return _aligned(token_idx, flat[order], order, inverse, counts, n, per_token)
        perm = Permutation(
            token_idx, flat[order], n, padded=False, per_token=per_token, order=(order, inverse)
        )
        return perm, counts
    pairs = routing_map.t().nonzero()  # [M, 2] (expert, token), expert-major
    perm = Permutation(pairs[:, 1], pairs[:, 0], n, padded=False, per_token=per_token)
    return perm, counts


def _counting_order(routing_map: Tensor, k: int, counts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(flat, order, inverse)`` of a map with exactly ``k`` True a row, by counting.

    ``flat [N*k]``: the experts of each token in ascending order, token-major (choice ``j``
    of token ``t`` at ``t*k + j``); ``order [N*k]``: the token-major positions in
    expert-major order, tokens ascending inside each expert (a stable sort of ``flat``, as
    ``nonzero`` of the transposed map gives); ``inverse``: ``order``'s inverse permutation.

    A pair's place in its row (its choice ``j``) is the row's running count, its place in the
    expert's block the column's running count after the blocks of the experts before it:
    two scans, a compare-and-count and gathers, which the compiler fuses, where two stable
    sorts (a segmented one over every row, then one over all ``N*k`` pairs) took ~12 ms of an
    H100's ``deepseek-v3-3b`` step (2026-12-07).
    """
    n = routing_map.shape[0]
    taken = routing_map.to(torch.int32)
    in_row = taken.cumsum(dim=1)  # [N, E]: the pairs of the row up to this expert
    choices = torch.arange(k, device=routing_map.device, dtype=torch.int32)
    # the j-th expert of a row: how many experts come before the row's (j+1)-th pair
    chosen = (in_row.unsqueeze(1) <= choices.view(1, k, 1)).sum(dim=-1)  # [N, k]
    starts = torch.cumsum(counts, dim=0) - counts  # [E]: where each expert's block starts
    place = starts.unsqueeze(0) + taken.cumsum(dim=0) - 1  # [N, E]: a pair's expert-major row
    inverse = place.gather(1, chosen).flatten()  # [N*k]: token-major -> expert-major
    order = torch.empty_like(inverse)
    order[inverse] = torch.arange(n * k, device=routing_map.device, dtype=inverse.dtype)
    return chosen.flatten(), order, inverse


def _aligned(
    token_idx: Tensor,
    expert_idx: Tensor,
    order: Tensor,
    inverse: Tensor,
    counts: Tensor,
    n: int,
    k: int,
) -> tuple[Permutation, Tensor]:
    """The expert-major permutation moved into the 16-row aligned layout: each row at its
    padded place, the gaps pointing at the sentinels (token ``n``, token-major row ``n*k``)."""
    rows = token_idx.numel()
    layout = padded_rows(counts, rows, token_idx.device)
    dest, cap = layout.dest, layout.capacity
    assert dest is not None

    def placed(values: Tensor, fill: int) -> Tensor:
        out = torch.full((cap,), fill, dtype=values.dtype, device=values.device)
        return out.index_copy(0, dest, values)

    ends = layout.ends.long()
    sizes = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
    perm = Permutation(placed(token_idx, n), placed(expert_idx, 0), n, padded=True, per_token=k,
                       order=(placed(order, rows), dest[inverse]))  # fmt: skip
    return perm, sizes


def capacity_slots(routing_map: Tensor, capacity: int) -> Permutation:
    """Exactly ``capacity`` rows per expert; needs at most ``capacity`` tokens per expert."""
    n, e = routing_map.shape
    pos = routing_map.long().cumsum(dim=0) - 1  # [N, E] slot of each token in its expert
    pos = torch.where(routing_map, pos, capacity)  # unrouted pairs go to a discarded slot
    slots = torch.full((e, capacity + 1), n, dtype=torch.long, device=routing_map.device)
    tokens = torch.arange(n, device=routing_map.device).expand(e, n)
    slots.scatter_(1, pos.t(), tokens)  # [E, C+1]
    token_idx = slots[:, :capacity].flatten()  # [E*C]
    expert_idx = torch.arange(e, device=routing_map.device).repeat_interleave(capacity)
    return Permutation(token_idx, expert_idx, n, padded=True)


def chunk_permutation(sizes: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """Reorder row chunks from ``(a, b)`` order to ``(b, a)`` order.

    ``sizes [A, B]`` holds the rows of chunk (a, b); rows are laid out chunk after chunk
    with a outer. Returns ``perm`` (new row i is old row ``perm[i]``) and its inverse.
    """
    flat = sizes.flatten()
    starts = flat.cumsum(0) - flat
    order = torch.arange(flat.numel(), device=sizes.device).view(sizes.shape).t().flatten()
    new_sizes, new_starts = flat[order], starts[order]
    shift = new_starts - (new_sizes.cumsum(0) - new_sizes)  # old start - new start, per chunk
    perm = torch.arange(total, device=sizes.device) + torch.repeat_interleave(
        shift, new_sizes, output_size=total
    )
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(total, device=sizes.device)
    return perm, inverse
