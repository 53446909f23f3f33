"""The column-parallel linear as a function: ``x @ W^T`` with ``W`` split by output rows.

At tp > 1 its autograd Function gathers the sequence under sequence parallel before the
GEMM, and in backward issues the input gradient's all-reduce (or reduce-scatter)
asynchronously, overlapped with the weight-gradient GEMM; under
:func:`~mega_tp_layers.defer_weight_grads` the weight GEMM waits for the W pass instead
(:func:`_column_dgrad_deferring_wgrad`). With an fp8 recipe the three GEMMs run in FP8
(``mega_tp_layers.fp8``), the weight shard scaled as the whole weight and quantised once a
micro-batch (or read from the layer's :class:`~mega_tp_layers.Fp8WeightCache`) for both the
forward and the dgrad GEMM. :class:`~mega_tp_layers.ColumnParallelLinear` is the module.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function
from torch.distributed import ProcessGroup

from mega_tp_layers._comm import (
    all_gather_dim0,
    all_reduce,
    group_size,
    reduce_scatter_dim0,
)
from mega_tp_layers.fp8 import (
    Fp8Recipe,
    Fp8Shard,
    Fp8Tensor,
    check_delayed,
    check_weight_q,
    fp8_linear,
    fp8_linear_dgrad,
    fp8_linear_forward,
    fp8_linear_wgrad,
    fp8_quantize,
    shared_grad,
)
from mega_tp_layers.fp8_delayed import Fp8Delayed, recorded_amax
from mega_tp_layers.fp8_scaling import check_fp8_layout
from mega_tp_layers.main_grad_fusion import linear_wgrad_into_main_grad
from mega_tp_layers.mappings import gather_from_tp_region
from mega_tp_layers.overlap import all_gather_linear, check_tp_comm_overlap
from mega_tp_layers.wgrad import (
    WeightGradStore,
    current_weight_grad_store,
    flat_wgrad,
    linear_with_wgrad,
)

__all__ = ["column_parallel_linear"]


class _ColumnParallelMatmul(Function):
    """fwd: (SP: all-gather dim 0) + GEMM · bwd: dgrad all-reduce/reduce-scatter overlaps wgrad"""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        group: ProcessGroup,
        sequence_parallel: bool,
        fp8: Fp8Recipe | None,
        deferred: tuple[WeightGradStore, Tensor, Tensor | None] | None,
        amax: Tensor | None,
        probe: Tensor | None,
        w_data: Tensor | None,
        w_inv: Tensor | None,
        w_col: Tensor | None,
        wgrad_key: Tensor | None,
    ) -> Tensor:
        ctx.group = group
        ctx.wgrad_key = wgrad_key  # the weight gradient into main_grad (main_grad_fusion)
        ctx.sequence_parallel = sequence_parallel
        ctx.fp8 = fp8
        ctx.deferred = deferred  # (store, weight, bias): the W pass runs later from the store
        ctx.delayed = probe is not None  # delayed scaling: |dy|'s max is the probe's gradient
        x_amax, g_amax = (None, None) if amax is None else (amax[0], amax[1])
        if fp8 is not None and fp8.scaling == "tensor" and w_data is None:
            # the weight shard scaled as the whole, once for the forward and the dgrad
            fresh = fp8_quantize(weight, fp8.fwd_dtype, fp8.eps, group)
            w_data, w_inv = fresh.data, fresh.inv_scale
        # under SP only the local slice of x; w_col: a weight cache's column-major copy
        ctx.save_for_backward(x, weight, x_amax, g_amax, w_data, w_inv, w_col)
        total = all_gather_dim0(x, group)[0] if sequence_parallel else x  # [s/tp,b,h] -> [s,b,h]
        if fp8 is None:
            return F.linear(total, weight, bias)  # [s, b, h] -> [s, b, out/tp]
        # fp8 inputs are 2-D: [s*b, h] -> [s*b, out/tp]
        out = fp8_linear_forward(
            total, weight, fp8, w_group=Fp8Shard(group, 0), x_amax=x_amax,
            weight_q=_fp8_weight(w_data, w_inv, None),
        )  # fmt: skip
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, x_amax, g_amax, w_data, w_inv, w_col = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        group, sp, fp8 = ctx.group, ctx.sequence_parallel, ctx.fp8
        probe_grad = recorded_amax(grad) if ctx.delayed else None
        wq = _fp8_weight(w_data, w_inv, w_col)  # tensor-wise: the forward's fp8 weight
        if ctx.deferred is not None:
            return (
                *_column_dgrad_deferring_wgrad(
                    ctx.deferred, x, (weight, wq), grad, group, sp, fp8, (x_amax, g_amax),
                    ctx.wgrad_key,
                ),
                probe_grad,
                None,
                None,
                None,
                None,
            )  # fmt: skip
        total, gather = x, None
        if sp and need_w:  # rebuild the gathered input, overlapped with the dgrad GEMM
            total, gather = all_gather_dim0(x, group, async_op=True)
        grad_2d = grad.reshape(-1, grad.shape[-1])  # [s*b, out/tp]
        g8: Tensor | Fp8Tensor = grad_2d
        if fp8 is not None and (need_x or need_w):  # quantised once for dgrad and wgrad
            g8 = shared_grad(grad_2d, weight.shape[1], fp8, Fp8Shard(group, 1), g_amax)  # a shard
        grad_input, pending = None, None
        if need_x:
            grad_input = _dgrad(grad, g8, weight, wq, fp8, group, x.dtype)
            if sp:
                if gather is not None:
                    gather.wait()
                    gather = None
                grad_input, pending = reduce_scatter_dim0(grad_input, group, async_op=True)
            else:
                pending = all_reduce(grad_input, group, async_op=True)
        if gather is not None:
            gather.wait()
        grad_weight = grad_bias = None
        if need_w or need_b:  # runs while the input-gradient collective is in flight
            total_2d = total.reshape(-1, total.shape[-1])  # [s*b, h]
            if need_w and fp8 is not None:
                grad_weight = fp8_linear_wgrad(
                    g8, total_2d, fp8, out_dtype=weight.dtype, x_amax=x_amax
                )  # the forward's scale (delayed: the history's)
            elif need_w and ctx.wgrad_key is not None:
                grad_weight = linear_wgrad_into_main_grad(grad_2d, total_2d, weight, ctx.wgrad_key)
            elif need_w:
                grad_weight = grad_2d.t().matmul(total_2d)
            if need_b:
                grad_bias = grad_2d.sum(dim=0)
        if pending is not None:
            pending.wait()
        return (
            grad_input, grad_weight, grad_bias, None, None, None, None, None, probe_grad,
            None, None, None, None,
        )  # fmt: skip


def _dgrad(
    grad: Tensor,
    g8: Tensor | Fp8Tensor,
    weight: Tensor,
    wq: Fp8Tensor | None,
    fp8: Fp8Recipe | None,
    group: ProcessGroup,
    dtype: torch.dtype,
) -> Tensor:
    """The input gradient, partial over tp: ``grad @ weight`` (``[s, b, out/tp] -> [s, b, h]``),
    or in fp8 from the shared quantised gradient ``g8`` and the forward's fp8 weight ``wq``."""
    if fp8 is None:
        return grad.matmul(weight)
    return fp8_linear_dgrad(
        g8, weight, fp8, out_dtype=dtype, weight_q=wq,
        g_group=Fp8Shard(group, 1), w_group=Fp8Shard(group, 0),
    )  # fmt: skip


def _fp8_weight(
    data: Tensor | None, inv_scale: Tensor | None, col_major: Tensor | None
) -> Fp8Tensor | None:
    return None if data is None or inv_scale is None else Fp8Tensor(data, inv_scale, col_major)


def _column_dgrad_deferring_wgrad(
    deferred: tuple[WeightGradStore, Tensor, Tensor | None],
    x: Tensor,
    weights: tuple[Tensor, Fp8Tensor | None],
    grad: Tensor,
    group: ProcessGroup,
    sp: bool,
    fp8: Fp8Recipe | None,
    amaxes: tuple[Tensor | None, Tensor | None],
    wgrad_key: Tensor | None = None,
) -> tuple[Tensor | None, ...]:
    """The input gradient now; the weight gradient (SP: from a new all-gather) in the W pass.

    Under SP the W pass gathers the input again rather than keeping the gathered copy:
    the fused backward gathers it again too (the same traffic, moved from B to W), and
    keeping it would hold tp times the input per linear for every micro-batch whose W
    is pending. With ``fp8`` both GEMMs use one quantised gradient, as the fused ones do;
    ``amaxes``: delayed scaling's (input, gradient) amaxes, or None each; ``weights``: the
    weight and, tensor-wise, the forward's fp8 copy of it; ``wgrad_key``: the weight
    gradient goes into its ``main_grad`` (``mega_tp_layers.main_grad_fusion``).
    """
    store, w_param, b_param = deferred
    weight, wq = weights
    x_amax, g_amax = amaxes
    g8: Tensor | Fp8Tensor = grad
    if fp8 is not None:  # [s*b, out/tp], a shard of the gradient, quantised once
        g8 = shared_grad(grad, weight.shape[1], fp8, Fp8Shard(group, 1), g_amax)

    def wgrad() -> tuple[Tensor | None, ...]:
        total = all_gather_dim0(x, group)[0] if sp else x  # [s/tp, b, h] -> [s, b, h]
        if fp8 is None:
            into_main = None if wgrad_key is None else (w_param, wgrad_key)
            return flat_wgrad(grad, total, b_param is not None, into_main)
        grad_w = fp8_linear_wgrad(g8, total, fp8, out_dtype=weight.dtype, x_amax=x_amax)
        return grad_w, grad.sum(dim=0) if b_param is not None else None

    store.defer(wgrad, (w_param, b_param))
    grad_input = _dgrad(grad, g8, weight, wq, fp8, group, x.dtype)
    if sp:
        grad_input = reduce_scatter_dim0(grad_input, group)[0]  # -> [s/tp, b, h]
    else:
        all_reduce(grad_input, group)
    return grad_input, None, None, None, None, None, None, None


def column_parallel_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    tp_group: ProcessGroup,
    sequence_parallel: bool = False,
    gather_output: bool = False,
    fp8: Fp8Recipe | None = None,
    tp_comm_overlap: bool = False,
    fp8_delayed: Fp8Delayed | None = None,
    fp8_weight: Fp8Tensor | None = None,
    wgrad_key: Tensor | None = None,
) -> Tensor:
    """``x @ weight.T + bias`` with ``weight`` split by output rows over ``tp_group``.

    The functional form of :class:`ColumnParallelLinear`, e.g. for an output head tied to
    a :class:`~mega_tp_layers.VocabParallelEmbedding` weight. ``x`` is ``[s, b, h]``
    (``[s/tp, b, h]`` under sequence parallel); the result is ``[s, b, out/tp]``, or
    ``[s, b, out]`` with ``gather_output``. With ``fp8`` its three GEMMs run in FP8. With
    ``tp_comm_overlap`` (needs ``sequence_parallel`` and tp > 1) the all-gather overlaps
    the GEMM chunk by chunk, and the input gradient's reduce-scatter its GEMM.
    ``fp8_delayed``: a delayed-scaling recipe's scales and probe (``fp8_delayed``);
    ``fp8_weight``: ``weight`` quantised already, tensor-wise (a layer's weight cache).
    ``wgrad_key``: the weight gradient goes into ``weight.main_grad`` under this key
    (``mega_tp_layers.main_grad_fusion``; bf16 paths only, not with ``fp8`` or the rings).
    """
    check_delayed("column_parallel_linear", fp8, fp8_delayed)
    _check_fp8_weight("column_parallel_linear", fp8, fp8_weight, weight)
    tp = group_size(tp_group)
    overlap = check_tp_comm_overlap(
        "column_parallel_linear", tp_comm_overlap, sequence_parallel, tp
    )
    check_fp8_layout("column_parallel_linear", fp8, tp, ("out/tp", weight.shape[0]), overlap)
    if wgrad_key is not None and (overlap or fp8 is not None):
        raise ValueError(
            "column_parallel_linear got a wgrad_key, but its "
            f"{'tp_comm_overlap rings' if overlap else 'fp8 GEMMs'} do not add the weight "
            "gradient into main_grad; pass wgrad_key=None there"
        )
    if overlap:
        out = all_gather_linear(x, weight, bias, tp_group=tp_group, fp8=fp8)
        return gather_from_tp_region(out, tp_group) if gather_output else out
    # an input without a gradient has no B for W to follow: the backward stays fused
    store = current_weight_grad_store() if x.requires_grad else None
    if tp == 1:
        if fp8 is not None:
            return fp8_linear(
                x, weight, bias, recipe=fp8, store=store, delayed=fp8_delayed,
                weight_q=fp8_weight,
            )  # fmt: skip
        return linear_with_wgrad(x, weight, bias, store, wgrad_key)
    deferred = None
    if store is not None:  # the weight leaves the graph: its gradient arrives in the W pass
        deferred = (store, weight, bias)
        weight, bias = weight.detach(), None if bias is None else bias.detach()
    if fp8 is None:
        out = _ColumnParallelMatmul.apply(
            x, weight, bias, tp_group, sequence_parallel, None, deferred, None, None, *(None,) * 3,
            wgrad_key,
        )  # fmt: skip
    else:  # the Function runs on [tokens, h]; gathering dim 0 keeps the sequence-major order
        lead = (x.shape[0] * (group_size(tp_group) if sequence_parallel else 1), *x.shape[1:-1])
        flat = x.reshape(-1, x.shape[-1])  # [s(/tp), b, h] -> [s(/tp)*b, h]
        amax, probe = (None, None) if fp8_delayed is None else fp8_delayed
        w8 = (None,) * 3 if fp8_weight is None else tuple(fp8_weight)
        out = _ColumnParallelMatmul.apply(
            flat, weight, bias, tp_group, sequence_parallel, fp8, deferred, amax, probe, *w8,
            None,
        )  # fmt: skip
        out = out.view(*lead, weight.shape[0])  # [s*b, out/tp] -> [s, b, out/tp]
    if gather_output:
        out = gather_from_tp_region(out, tp_group)  # [s, b, out/tp] -> [s, b, out]
    return out


def _check_fp8_weight(
    owner: str, fp8: Fp8Recipe | None, fp8_weight: Fp8Tensor | None, weight: Tensor
) -> None:
    if fp8_weight is not None and fp8 is None:
        raise ValueError(
            f"{owner} got an fp8_weight but no fp8 recipe; pass fp8=Fp8Recipe() or drop fp8_weight"
        )
    if fp8 is not None:
        check_weight_q(owner, fp8_weight, weight, fp8)
