"""Routing math as pure functions on fp32 logits: expert choice, capacity, balancing losses.

The balancing losses are written as one rank's *share*: with statistics summed over a
group of ranks (``counts``, ``tokens``), the shares of the ranks of the group add up to
the loss over all their tokens, and each share's gradient is exactly that loss's gradient
with respect to this rank's logits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mega_moe.config import RouterConfig
from mega_moe.row_topk import row_topk

__all__ = [
    "drop_over_capacity",
    "group_limited_mask",
    "select_experts",
    "seq_aux_loss_share",
    "switch_aux_loss_share",
    "z_loss_share",
]


def group_limited_mask(
    selection: Tensor, num_groups: int, group_topk: int, scored_by: int
) -> Tensor:
    """``[N, E]`` True on the experts of each token's best ``group_topk`` groups.

    A group scores the sum of its best ``scored_by`` selection scores.
    """
    n, e = selection.shape
    grouped = selection.view(n, num_groups, e // num_groups)  # [N, G, E/G]
    group_scores = row_topk(grouped, scored_by)[0].sum(dim=-1)  # [N, G]
    best = row_topk(group_scores, group_topk)[1]  # [N, group_topk]
    chosen = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
    return chosen.unsqueeze(-1).expand_as(grouped).reshape(n, e)


def select_experts(
    logits: Tensor, config: RouterConfig, expert_bias: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Choose ``top_k`` experts per token.

    ``logits [N, E]`` in fp32. Returns the combine weights ``[N, k]``, the expert indices
    ``[N, k]`` and the per-token score distribution ``[N, E]`` the balancing losses use
    (softmax of the logits, or the sigmoid scores divided by their sum).
    """
    c = config
    if c.score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
        balance = scores
        selection = scores if c.softmax_before_topk else logits
    else:
        scores = torch.sigmoid(logits)
        balance = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        selection = scores
    if expert_bias is not None:  # the bias steers the choice only, never the weights
        selection = selection.detach() + expert_bias
    else:
        selection = selection.detach()
    if c.num_groups is not None and c.group_topk is not None:
        keep = group_limited_mask(selection, c.num_groups, c.group_topk, c.group_scored_by)
        selection = selection.masked_fill(~keep, float("-inf"))
    index = row_topk(selection, c.top_k)[1]  # [N, k]
    if c.score_function == "softmax" and not c.softmax_before_topk:
        weights = torch.softmax(logits.gather(1, index), dim=-1)
    else:
        weights = scores.gather(1, index)
        if c.normalize_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if c.scaling_factor != 1.0:
        weights = weights * c.scaling_factor
    return weights, index, balance


def drop_over_capacity(routing_map: Tensor, probs: Tensor, capacity: int, policy: str) -> Tensor:
    """The pairs of ``routing_map [N, E]`` an expert of ``capacity`` keeps.

    ``"probs"``: the ``capacity`` highest combine weights of each expert; ``"position"``:
    its first ``capacity`` tokens in token order.
    """
    if policy == "position":
        return routing_map & (routing_map.long().cumsum(dim=0) <= capacity)
    kept = min(capacity, routing_map.shape[0])
    ranked = probs.detach().masked_fill(~routing_map, -1.0)  # weights are >= 0
    best = ranked.topk(kept, dim=0).indices  # [C, E]
    return routing_map & torch.zeros_like(routing_map).scatter(0, best, True)


def switch_aux_loss_share(
    balance: Tensor, counts: Tensor, tokens: Tensor, top_k: int, coeff: float
) -> Tensor:
    """This rank's share of ``coeff * E * sum_i f_i P_i`` over the group's tokens.

    ``f_i = counts_i / (tokens * k)`` is the fraction of choices that went to expert i and
    ``P_i`` the mean of ``balance[:, i]``; ``counts [E]`` and ``tokens`` are group totals.
    """
    e = balance.shape[-1]
    scale = coeff * e / (top_k * tokens.square())
    return scale * (counts * balance.sum(dim=0)).sum()


def seq_aux_loss_share(
    balance: Tensor, seq_counts: Tensor, seq_len: int, top_k: int, coeff: float
) -> Tensor:
    """This rank's share of the sequence-level loss, averaged over the ``b`` sequences.

    ``balance`` is ``[s_local * b, E]`` (sequence-first tokens); ``seq_counts [b, E]`` the
    choices per sequence and expert summed over the ranks that hold the sequence, whose
    full length is ``seq_len``.
    """
    b, e = seq_counts.shape
    per_seq = balance.view(-1, b, e).sum(dim=0)  # [b, E] local sums of P
    scale = coeff * e / (top_k * seq_len * seq_len * b)
    return scale * (seq_counts * per_seq).sum()


def z_loss_share(logits: Tensor, tokens: int, coeff: float) -> Tensor:
    """This rank's share of ``coeff * mean(logsumexp(logits)^2)`` over ``tokens`` tokens."""
    return coeff * torch.logsumexp(logits, dim=-1).square().sum() / tokens
