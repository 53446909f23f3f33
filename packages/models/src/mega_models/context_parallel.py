"""Context parallelism: the sequence split over ``cp`` ranks, attention exchanging K/V.

The sequence is cut into ``2 * cp`` equal chunks and rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r`` (zig-zag), so that under a causal mask every rank does the same work.
Two ways to attend: ``"ring"`` passes K/V blocks around the cp ring and merges the partial
results by their log-sum-exp in fp32; ``"all_gather"`` gathers K/V once and runs one masked
attention. Gradients flow back through the same exchange.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

if TYPE_CHECKING:
    from mega_models.doc_mask import DocumentMask

__all__ = ["context_parallel_attention", "zigzag_positions", "zigzag_split"]


def zigzag_positions(
    seq_len: int, cp: int, rank: int, device: torch.device | None = None
) -> torch.Tensor:
    """Absolute positions of the tokens that cp rank ``rank`` holds, in local order."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"sequence length ({seq_len}) is not divisible by 2*cp ({2 * cp}); "
            f"use a multiple of {2 * cp}"
        )
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last_idx = 2 * cp - 1 - rank
    second = torch.arange(last_idx * chunk, (last_idx + 1) * chunk, device=device)
    return torch.cat([first, second])


def zigzag_split(x: torch.Tensor, cp: int, rank: int, dim: int = 0) -> torch.Tensor:
    """This cp rank's zig-zag share of ``x`` along ``dim`` (the sequence dimension)."""
    if cp == 1:
        return x
    positions = zigzag_positions(x.shape[dim], cp, rank, device=x.device)
    return x.index_select(dim, positions)


class _RingShift(torch.autograd.Function):
    """fwd: send to the next cp rank, receive from the previous · bwd: the reverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _shift(x, group, +1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _shift(grad, ctx.group, -1), None


def _shift(x: torch.Tensor, group: ProcessGroup, step: int) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    dst = dist.get_global_rank(group, (rank + step) % size)
    src = dist.get_global_rank(group, (rank - step) % size)
    x = x.contiguous()
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, dst, group), dist.P2POp(dist.irecv, out, src, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


class _AllGatherSeq(torch.autograd.Function):
    """fwd: all-gather along dim 0 · bwd: reduce-scatter along dim 0."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        size = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


def _block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised attention of one K/V block in fp32: (row max, row sum, weighted values).

    A row the mask hides entirely has max -inf, sum 0 and values 0, so merging it weighs
    it by exp(-inf) = 0 whatever the other blocks' maxima are (a stand-in max of 0 would
    underflow the real block's weight once its scores fall below about -88).
    """
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [b, n, sq, sk]
    scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)  # -inf on fully masked rows
    shift = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    probs = torch.exp(scores - shift)  # 0 where masked
    return row_max, probs.sum(dim=-1, keepdim=True), torch.matmul(probs, v.float())


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cp_group: ProcessGroup,
    seq_len: int,
    method: Literal["ring", "all_gather"] = "ring",
    scale: float | None = None,
    documents: DocumentMask | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's zig-zag share of the sequence.

    ``q`` is ``[b, n, s/cp, d]``, ``k`` is ``[b, n_kv, s/cp, d]`` and ``v`` is
    ``[b, n_kv, s/cp, d_v]`` (GQA: n_kv divides n; MLA: d_v may differ from d), all in the
    local zig-zag order; returns ``[b, n, s/cp, d_v]`` in q's dtype. ``scale`` multiplies
    the scores (default ``1/sqrt(d)``). K and V travel as one ``[.., d + d_v]`` message.
    ``documents`` (packed documents, ``"all_gather"`` only) keeps each query inside its
    document: the mask of :func:`~mega_models.doc_mask.document_mask` for this rank.
    """
    cp, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    groups = q.shape[1] // k.shape[1]
    d = k.shape[-1]
    scale = d**-0.5 if scale is None else scale
    q_pos = zigzag_positions(seq_len, cp, rank, device=q.device)
    kv = torch.cat([k, v], dim=-1)  # [b, n_kv, s/cp, d + d_v]: one message per exchange
    if method == "all_gather":
        gathered: torch.Tensor = _AllGatherSeq.apply(kv.permute(2, 0, 1, 3), cp_group)
        # [s, b, n_kv, d + d_v] -> [b, n_kv, s, d], [b, n_kv, s, d_v]
        k_all, v_all = torch.split(gathered.permute(1, 2, 0, 3), [d, v.shape[-1]], dim=-1)
        if documents is not None:  # the mask's keys are in this all-gathered order
            from mega_models.doc_mask import document_attention

            return document_attention(q, k_all, v_all, documents, scale=scale)
        k_pos = torch.cat([zigzag_positions(seq_len, cp, r, device=q.device) for r in range(cp)])
        mask = q_pos[:, None] >= k_pos[None, :]
        return F.scaled_dot_product_attention(
            q, k_all, v_all, attn_mask=mask, enable_gqa=groups > 1, scale=scale
        )
    if method != "ring":
        raise ValueError(f"context-parallel method ({method!r}) must be 'ring' or 'all_gather'")
    if documents is not None:
        raise ValueError(
            "packed-document attention under context parallel needs the 'all_gather' method, "
            "not 'ring'; set parallel.cp_method to all_gather"
        )
    out = total = running_max = None
    for step in range(cp):
        src = (rank - step) % cp
        k_blk, v_blk = torch.split(kv, [d, v.shape[-1]], dim=-1)
        if groups > 1:
            k_blk = k_blk.repeat_interleave(groups, dim=1)
            v_blk = v_blk.repeat_interleave(groups, dim=1)
        mask = q_pos[:, None] >= zigzag_positions(seq_len, cp, src, device=q.device)[None, :]
        m, s, o = _block(q, k_blk, v_blk, mask, scale)
        if out is None or total is None or running_max is None:
            out, total, running_max = o, s, m
        else:  # merge by log-sum-exp, in fp32; the first block (this rank's own, holding
            # each query's own position) leaves every running max finite
            new_max = torch.maximum(running_max, m)
            a, b = torch.exp(running_max - new_max), torch.exp(m - new_max)  # exp(-inf) = 0
            out, total, running_max = out * a + o * b, total * a + s * b, new_max
        if step < cp - 1:
            kv = _RingShift.apply(kv, cp_group)
    assert out is not None and total is not None
    return (out / total).to(q.dtype)
