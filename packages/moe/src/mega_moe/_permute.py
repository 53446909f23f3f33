"""Permute tokens into expert-major order and back (weighted by the router's probabilities).

Token order inside one expert's block is ascending token index. A padded layout gives
every expert exactly ``capacity`` rows; empty slots point at a sentinel zero row ``N``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Permutation", "capacity_slots", "chunk_permutation", "sort_by_expert"]


class Permutation:
    """Where each row of the expert-major layout comes from, and its combine weight."""

    def __init__(
        self,
        token_idx: Tensor,
        expert_idx: Tensor,
        num_tokens: int,
        padded: bool,
        per_token: int | None = None,
    ) -> None:
        self.token_idx = token_idx  # [M] source token (N = the zero sentinel when padded)
        self.expert_idx = expert_idx  # [M] expert (column of the routing map) of each row
        self.num_tokens = num_tokens
        self.padded = padded
        self.per_token = per_token  # every token has exactly this many rows (no dropping)

    def gather(self, x: Tensor) -> Tensor:
        """``[N, ...] -> [M, ...]``: the rows in expert-major order (zeros in empty slots)."""
        if self.padded:
            x = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])  # [N+1, ...], row N is zero
        return x.index_select(0, self.token_idx)

    def weights(self, probs: Tensor) -> Tensor:
        """The combine weight of each row, ``probs[token, expert]`` (0 in empty slots)."""
        if self.padded:
            probs = torch.cat([probs, probs.new_zeros((1, probs.shape[1]))])
        return probs[self.token_idx, self.expert_idx]  # [M]

    def scatter_add(self, y: Tensor, weights: Tensor) -> Tensor:
        """``[M, h] -> [N, h]``: sum each token's rows times their weights.

        With ``per_token`` rows per token, one batched GEMM ``[N, 1, k] x [N, k, h]`` does
        it (fp32 accumulation, no fp32 copy of ``y``, deterministic); otherwise an fp32
        ``index_add``.
        """
        k = self.per_token
        if k is not None:
            order = torch.argsort(self.token_idx, stable=True)  # expert-major -> token-major
            per = y.index_select(0, order).view(self.num_tokens, k, y.shape[-1])  # [N, k, h]
            w = weights.index_select(0, order).view(self.num_tokens, 1, k).to(y.dtype)
            return torch.bmm(w, per).view(self.num_tokens, y.shape[-1])  # [N, h]
        rows = self.num_tokens + (1 if self.padded else 0)
        out = torch.zeros((rows, y.shape[-1]), dtype=torch.float32, device=y.device)
        out = out.index_add(0, self.token_idx, y.float() * weights.unsqueeze(-1))
        return out[: self.num_tokens].to(y.dtype)


def sort_by_expert(routing_map: Tensor, per_token: int | None = None) -> tuple[Permutation, Tensor]:
    """The kept (token, expert) pairs of ``routing_map [N, E]`` in expert-major order.

    ``per_token``: every row of the map holds exactly this many True (no dropping).
    Returns the permutation and the per-expert counts ``[E]`` (on the device).
    """
    n = routing_map.shape[0]
    counts = routing_map.sum(dim=0)
    if per_token is not None:
        # exactly k experts per token: M = N*k rows, a static shape (no host sync, no
        # graph break under torch.compile). A stable sort of the token-major expert ids is
        # expert-major with ascending token index inside each expert, as nonzero gives.
        chosen = torch.argsort((~routing_map).to(torch.uint8), dim=1, stable=True)[:, :per_token]
        flat = chosen.flatten()  # [N*k] expert of each (token, choice), token-major
        order = torch.argsort(flat, stable=True)
        token_idx = torch.div(order, per_token, rounding_mode="floor")
        return Permutation(token_idx, flat[order], n, padded=False, per_token=per_token), counts
    pairs = routing_map.t().nonzero()  # [M, 2] (expert, token), expert-major
    perm = Permutation(pairs[:, 1], pairs[:, 0], n, padded=False, per_token=per_token)
    return perm, counts


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
