"""The ``k`` largest entries of each row, as ``k`` rounds of a row maximum.

Routing takes a few largest of a few dozen scores per token (DeepSeek-V3: the best 2 of 8 in
each of 8 groups, the best 4 groups, the best 8 experts), for every token of every MoE layer
and micro-batch. ``torch.topk`` runs that as a radix-select kernel per call that the compiler
cannot fuse (``gatherTopK``: 17.7 ms of an H100's ``deepseek-v3-3b`` step, 2026-12-07). Written
as ``k`` rounds of max and mask, the selection is pointwise and row reductions over a row that
fits one block, which Inductor fuses with the scores around it; eager, ``torch.topk`` stays
(one launch against the rounds' several per round).

Ties: the rounds take the lowest index among equal entries (deterministic). ``torch.topk``
leaves the order of ties unspecified, so where scores tie exactly the compiled and the eager
choice may name different (equally scored) entries; their values agree.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ROUNDS_MAX_K", "row_topk"]

#: The largest ``k`` the rounds take; beyond it each round's cost outweighs ``torch.topk``.
ROUNDS_MAX_K = 16


def row_topk(x: Tensor, k: int, *, rounds: bool | None = None) -> tuple[Tensor, Tensor]:
    """``(values, indices)`` of the ``k`` largest entries along the last dim, descending.

    ``rounds``: take them by ``k`` rounds of max (None: while compiling, for ``k`` up to
    :data:`ROUNDS_MAX_K`), else ``torch.topk``. NaN ranks above every number, as in
    ``torch.topk``; the indices of one row are always distinct, even where fewer than ``k``
    entries are finite.
    """
    if not 0 < k <= x.shape[-1]:
        raise ValueError(f"row_topk: k ({k}) must be in 1..{x.shape[-1]} (the row length)")
    if rounds is None:
        rounds = k <= ROUNDS_MAX_K and torch.compiler.is_compiling()
    if not rounds:
        top = torch.topk(x, k, dim=-1)
        return top.values, top.indices
    columns = torch.arange(x.shape[-1], device=x.device)
    taken = torch.zeros_like(x, dtype=torch.bool)
    values: list[Tensor] = []
    indices: list[Tensor] = []
    for _ in range(k):
        left = x.masked_fill(taken, float("-inf"))
        best = left.amax(dim=-1, keepdim=True)  # NaN where the row has one left
        hit = ((left == best) | (left.isnan() & best.isnan())) & ~taken
        index = hit.to(torch.int8).argmax(dim=-1, keepdim=True)  # the first such entry
        taken = taken | (columns == index)
        values.append(best)
        indices.append(index)
    return torch.cat(values, dim=-1), torch.cat(indices, dim=-1)
