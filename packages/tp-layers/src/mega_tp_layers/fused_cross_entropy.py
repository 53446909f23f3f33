"""The output projection and the cross-entropy in one pass over token chunks.

``fused_linear_cross_entropy(x, w, t, g)`` is ``vocab_parallel_cross_entropy(
column_parallel_linear(x, w, tp_group=g), t, g)`` without the ``[tokens, V/tp]`` logits:
forward computes each chunk's logits (fp32), keeps only the per-token log-sum-exp, target
logit (and, with label smoothing, logit sum), and frees the chunk; the per-token statistics
of all chunks are made global over tp by one MAX and one SUM all-reduce. Backward recomputes
each chunk's logits from the saved input and weight, forms ``g * (softmax - target)``
there and multiplies it into the input gradient and an fp32 weight-gradient accumulator.
Peak memory is O(chunk x V/tp) instead of O(tokens x V/tp).

Why recompute rather than keep: the head returns per-token losses, reduced by the caller
(a mean, a masked sum, the MTP terms), so each token's upstream gradient is known only in
backward. The weight gradient ``sum_t g_t (p_t - y_t) h_t^T`` cannot be formed before it
without keeping ``[tokens, V]``; recomputing costs one more GEMM of the head's shape (four
instead of three).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd import Function
from torch.distributed import ProcessGroup

from mega_tp_layers._comm import all_reduce, all_reduce_max, group_rank, group_size
from mega_tp_layers.cross_entropy import (
    check_targets_dtype,
    check_vocab,
    target_columns,
    token_loss,
)
from mega_tp_layers.mappings import copy_to_tp_region, gather_from_sequence_region

__all__ = ["fused_linear_cross_entropy"]


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` as fp32: fp32 accumulation and output (a GPU's bf16 GEMM writes fp32)."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a, b).float()  # CPU has no mixed-dtype GEMM: rounded once, then fp32


def _addmm_fp32(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` into the fp32 accumulator ``acc``."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif a.is_cuda and not torch.compiler.is_compiling():
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    elif a.is_cuda:  # dynamo cannot trace addmm's out_dtype with out= (torch 2.11, the H200)
        acc.add_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        acc.add_(torch.mm(a, b))


def _chunk_logits(hidden: Tensor, weight: Tensor, valid: int) -> Tensor:
    """``[c, h] @ [V/tp, h]^T -> [c, V/tp]`` in fp32; padding columns (from ``valid``) -inf."""
    logits = _mm_fp32(hidden, weight.t())
    if valid < logits.shape[1]:
        logits[:, valid:] = float("-inf")
    return logits


class _FusedLinearCrossEntropy(Function):
    """fwd: chunked logits, one MAX and one SUM all-reduce of per-token stats over tp ·
    bwd: chunked recompute, no comm (the input's all-reduce is the caller's mapping)"""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        group: ProcessGroup,
        chunk: int,
        label_smoothing: float,
        ignore_index: int,
        vocab_size: int,
    ) -> Tensor:
        tp, rank = group_size(group), group_rank(group)
        per_rank, tokens = weight.shape[0], hidden.shape[0]
        start = rank * per_rank
        valid = min(max(vocab_size - start, 0), per_rank)  # real (unpadded) columns here
        local_t, outside, bad = target_columns(targets, start, per_rank, vocab_size, ignore_index)
        f32, dev = torch.float32, hidden.device
        lse = torch.full((tokens,), float("-inf"), dtype=f32, device=dev)  # this rank's
        # per token: target logit, sum of exp (filled at tp > 1), sum of real logits
        stats = torch.zeros((3 if label_smoothing > 0.0 else 2, tokens), dtype=f32, device=dev)
        for lo in range(0, tokens if valid > 0 else 0, chunk):  # a pure-padding shard: skip
            hi = min(lo + chunk, tokens)
            logits = _chunk_logits(hidden[lo:hi], weight, valid)  # [c, V/tp] fp32
            stats[0, lo:hi] = logits.gather(1, local_t[lo:hi, None]).squeeze(1)
            if label_smoothing > 0.0:
                stats[2, lo:hi] = logits[:, :valid].sum(dim=1)
            top = logits.amax(dim=1)  # [c]
            lse[lo:hi] = top + logits.sub_(top[:, None]).exp_().sum(dim=1).log()
            del logits
        stats[0].masked_fill_(outside, 0.0)
        if tp > 1:  # log-sum-exp over ranks: m + log(sum_r exp(lse_r - m))
            top = lse.clone()
            all_reduce_max(top, group)
            stats[1] = (lse - top).exp()
            all_reduce(stats, group)
            lse = top + stats[1].log()
        ignored = targets == ignore_index
        loss = token_loss(lse, stats, label_smoothing, vocab_size, ignored, bad)
        ctx.save_for_backward(hidden, weight, lse, local_t, outside, ignored)
        ctx.chunk, ctx.label_smoothing = chunk, label_smoothing
        ctx.valid, ctx.vocab_size = valid, vocab_size
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, lse, local_t, outside, ignored = ctx.saved_tensors
        eps, valid, chunk = ctx.label_smoothing, ctx.valid, ctx.chunk
        scale = grad_loss.float().masked_fill(ignored, 0.0)  # [t]
        hit = (~outside).float() * (1.0 - eps)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = hidden.new_zeros(hidden.shape) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for lo in range(0, hidden.shape[0] if valid > 0 else 0, chunk):
            hi = min(lo + chunk, hidden.shape[0])
            h = hidden[lo:hi]
            grad = _chunk_logits(h, weight, valid)  # [c, V/tp] fp32, recomputed
            grad.sub_(lse[lo:hi, None]).exp_()  # softmax (padding: 0)
            grad.scatter_add_(1, local_t[lo:hi, None], -hit[lo:hi, None])
            if eps > 0.0:
                grad[:, :valid] -= eps / ctx.vocab_size
            if grad.dtype == weight.dtype:
                grad_lowp = grad.mul_(scale[lo:hi, None])
            else:  # scale and round in one pass
                grad_lowp = torch.empty_like(grad, dtype=weight.dtype)
                torch.mul(grad, scale[lo:hi, None], out=grad_lowp)
            del grad
            if grad_x is not None:
                grad_x[lo:hi] = grad_lowp @ weight  # [c, V/tp] @ [V/tp, h]
            if need_w:
                _addmm_fp32(grad_w, grad_lowp.t(), h)  # [V/tp, c] @ [c, h]
        dw = grad_w.to(weight.dtype) if need_w else None
        return grad_x, dw, None, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    tp_group: ProcessGroup,
    *,
    sequence_parallel: bool = False,
    chunk_size: int = 4096,
    vocab_size: int | None = None,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
) -> Tensor:
    """Per-token cross-entropy (fp32, shaped like ``targets``) of ``hidden @ weight.T``,
    computed ``chunk_size`` tokens at a time so the logits never exist whole.

    ``hidden`` is ``[s, b, h]`` (``[s/tp, b, h]`` under ``sequence_parallel``, gathered
    here), ``weight`` this rank's ``[V_pad/tp, h]`` rows of the vocabulary (a
    ColumnParallelLinear's or a VocabParallelEmbedding's weight), ``targets`` ``[s, b]``
    global ids. Equal, up to rounding, to :func:`~mega_tp_layers.vocab_parallel_cross_entropy`
    of :func:`~mega_tp_layers.column_parallel_linear`'s output with the same
    ``vocab_size`` (the real vocabulary when the rows carry padding), ``label_smoothing``
    and ``ignore_index``; gradients reach ``hidden`` and ``weight`` (summed in fp32 over the
    chunks). Peak memory: about ``chunk_size x V_pad/tp`` fp32 values beyond the inputs.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"chunk_size ({chunk_size!r}) must be a positive number of tokens, e.g. 4096"
        )
    targets = check_targets_dtype(targets, "fused_linear_cross_entropy")
    tp = group_size(tp_group)
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden shape {tuple(hidden.shape)} does not fit weight shape "
            f"{tuple(weight.shape)}; the weight is [vocab rows, hidden] with hidden last in both"
        )
    gathered = (hidden.shape[0] * (tp if sequence_parallel else 1), *hidden.shape[1:-1])
    if gathered != tuple(targets.shape):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} does not match the tokens of hidden "
            f"{tuple(hidden.shape)}{f' gathered over tp {tp}' if sequence_parallel else ''}; "
            "pass one target per token"
        )
    vocab_size = check_vocab(vocab_size, weight.shape[0], tp_group, label_smoothing)
    if tp > 1:  # [s/tp, b, h] -> [s, b, h]; the input gradient is summed over tp in backward
        hidden = (
            gather_from_sequence_region(hidden, tp_group)
            if sequence_parallel
            else copy_to_tp_region(hidden, tp_group)
        )
    flat = hidden.reshape(-1, hidden.shape[-1])  # [s, b, h] -> [s*b, h]
    loss: Tensor = _FusedLinearCrossEntropy.apply(
        flat, weight, targets.reshape(-1), tp_group, chunk_size, float(label_smoothing),
        ignore_index, vocab_size,
    )  # fmt: skip
    return loss.view(targets.shape)
