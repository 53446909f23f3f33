"""Cross-entropy over a vocabulary split across tp ranks, never gathering the full logits.

Per token: the max logit, the sum of exponentials and the target's logit are each made
global by reductions over tp (one MAX all-reduce, then one SUM all-reduce carrying the
sums together); the gradient ``softmax - target`` is then purely local.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function
from torch.distributed import ProcessGroup

from mega_tp_layers._comm import all_reduce, group_rank, group_size

__all__ = ["vocab_parallel_cross_entropy"]


def target_columns(
    targets: Tensor, start: int, per_rank: int, vocab_size: int, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Each target's column in this rank's ``[start, start + per_rank)`` (0 where it is not
    here), whether it is not here, and whether it is no rank's (outside the real
    vocabulary and not ``ignore_index``: its loss is +inf, as nothing can be checked on the
    host without a sync)."""
    bad = ((targets < 0) | (targets >= vocab_size)) & (targets != ignore_index)
    outside = (targets < start) | (targets >= start + per_rank) | bad
    return (targets - start).masked_fill(outside, 0), outside, bad


def token_loss(
    log_z: Tensor,
    stats: Tensor,
    label_smoothing: float,
    vocab_size: int,
    ignored: Tensor,
    bad: Tensor,
) -> Tensor:
    """Per-token loss from the global log-partition and ``stats`` (target logit first, the
    sum of real logits third with smoothing), each relative to the same shift."""
    loss = log_z - stats[0]
    if label_smoothing > 0.0:
        smooth = log_z - stats[2] / vocab_size  # mean over the vocabulary of -log p
        loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
    return loss.masked_fill(ignored, 0.0).masked_fill(bad, float("inf"))


class _VocabParallelCrossEntropy(Function):
    """fwd: loss from a MAX and a SUM all-reduce over tp · bwd: local softmax - target, no comm"""

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        targets: Tensor,
        group: ProcessGroup,
        label_smoothing: float,
        ignore_index: int,
        vocab_size: int,
    ) -> Tensor:
        tp, rank = group_size(group), group_rank(group)
        per_rank = logits.shape[-1]
        start = rank * per_rank
        valid = min(max(vocab_size - start, 0), per_rank)  # real (unpadded) columns here
        shifted = logits.to(torch.float32, copy=True)  # the one fp32 working buffer [..., V/tp]
        if valid < per_rank:  # padding columns take no part in the softmax
            shifted[..., valid:] = float("-inf")
        top = shifted.max(dim=-1).values  # [...]
        if tp > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted.sub_(top.unsqueeze(-1))
        local_t, outside, bad = target_columns(targets, start, per_rank, vocab_size, ignore_index)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
        smooth_sum = shifted[..., :valid].sum(dim=-1) if label_smoothing > 0.0 else None
        exp = shifted.exp_()  # padding columns: exp(-inf) = 0
        parts = [target_logit.masked_fill(outside, 0.0), exp.sum(dim=-1)]
        if smooth_sum is not None:
            parts.append(smooth_sum)
        stats = torch.stack(parts)  # [2 or 3, ...]
        if tp > 1:
            all_reduce(stats, group)
        log_z = stats[1].log()
        ignored = targets == ignore_index
        loss = token_loss(log_z, stats, label_smoothing, vocab_size, ignored, bad)
        softmax = exp.div_(stats[1].unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside, ignored)
        ctx.label_smoothing, ctx.valid, ctx.vocab_size = label_smoothing, valid, vocab_size
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        softmax, local_t, outside, ignored = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype) * (1.0 - eps)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -hit.unsqueeze(-1))
        if eps > 0.0 and ctx.valid > 0:
            grad[..., : ctx.valid] -= eps / ctx.vocab_size
        grad.mul_(grad_loss.float().masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def check_targets_dtype(targets: Tensor, owner: str) -> Tensor:
    """Token ids must be integers (one sentence otherwise); returned as torch.long, which
    every kernel here indexes with (int32 or uint8 ids would work at one tp and not another)."""
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(
            f"{owner} expects integer targets, got dtype {targets.dtype}; "
            "pass a torch.long tensor of token ids"
        )
    return targets.long()


def check_vocab(
    vocab_size: int | None, per_rank: int, tp_group: ProcessGroup, label_smoothing: float
) -> int:
    """The real vocabulary (default: all ``per_rank x tp`` rows), checked with the smoothing."""
    held = per_rank * group_size(tp_group)
    if vocab_size is None:
        vocab_size = held
    # an integer: a fractional size would pass the range check and split the ranks (each
    # rank's real columns are computed from it: rank 0 would enter the all-reduce alone)
    if (
        isinstance(vocab_size, bool)
        or not isinstance(vocab_size, int)
        or not 1 <= vocab_size <= held
    ):
        raise ValueError(
            f"vocab_size ({vocab_size!r}) must lie in [1, {held}] and be an integer, the "
            f"vocabulary the shards hold ({per_rank} per rank x tp {group_size(tp_group)})"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing ({label_smoothing}) must lie in [0, 1]")
    return vocab_size


def vocab_parallel_cross_entropy(
    logits_shard: Tensor,
    targets: Tensor,
    tp_group: ProcessGroup,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    *,
    vocab_size: int | None = None,
) -> Tensor:
    """Per-token cross-entropy (fp32, shaped like ``targets``) from a vocabulary shard.

    ``logits_shard`` is ``[..., V_pad/tp]``: this rank's contiguous slice of the (padded)
    vocabulary, e.g. a ColumnParallelLinear output; ``targets`` holds global token ids,
    shaped like the logits without their last dimension. ``vocab_size`` is the real
    vocabulary when the shards carry padding columns, which are then left out of the
    softmax (default: no padding). Matches ``F.cross_entropy(..., reduction="none")``,
    including ``label_smoothing`` (spread over the real vocabulary) and ``ignore_index``
    (loss and gradient 0). Computed in fp32 whatever the logits' dtype.
    """
    targets = check_targets_dtype(targets, "vocab_parallel_cross_entropy")
    if logits_shard.dim() < 1 or tuple(logits_shard.shape[:-1]) != tuple(targets.shape):
        raise ValueError(
            f"logits shard shape {tuple(logits_shard.shape)} does not match targets shape "
            f"{tuple(targets.shape)}; the logits need one more (vocabulary) dimension, last"
        )
    vocab_size = check_vocab(vocab_size, logits_shard.shape[-1], tp_group, label_smoothing)
    held = logits_shard.shape[-1] * group_size(tp_group)
    if held == logits_shard.shape[-1]:
        # one rank holds the whole vocabulary: the library's fused kernel, which the
        # compiler can also fuse with the output projection (no fp32 copy of the logits)
        full = logits_shard[..., :vocab_size].float()
        # a target outside the vocabulary: +inf, as at tp > 1 (the kernel would raise)
        _, _, bad = target_columns(targets, 0, vocab_size, vocab_size, ignore_index)
        flat = F.cross_entropy(
            full.reshape(-1, vocab_size), targets.masked_fill(bad, ignore_index).reshape(-1),
            ignore_index=ignore_index, reduction="none", label_smoothing=float(label_smoothing),
        )  # fmt: skip
        return flat.view(targets.shape).masked_fill(bad, float("inf"))
    loss: Tensor = _VocabParallelCrossEntropy.apply(
        logits_shard, targets, tp_group, float(label_smoothing), ignore_index, vocab_size
    )
    return loss
