"""The experts' grouped linear with its forward and input-gradient GEMMs in FP8.

``y_l = x_l W_l^T`` over each expert's rows, as :func:`mega_moe._gemm.grouped_linear`, with
``x`` and the output gradient quantised per token row (:func:`~mega_moe.fp8_rows.quantize_rows`)
and the weight taken from its :class:`~mega_moe.fp8_expert_weights.Fp8ExpertWeights`. The
rows go through the 16-row padded layout (:class:`~mega_moe.fp8_rows.PaddedRows`) for the
GEMMs and come back in their order. The weight gradient stays in the activations' dtype
(an fp8 weight-gradient GEMM measured 0.86-1.08x bf16's at these shapes, 2026-12-06) and
is produced as the bf16 layer produces it: returned, added into ``main_grad``
(:mod:`mega_moe.wgrad_accum`), or left in a zero-bubble store's W pass.

On CUDA the GEMMs are ``torch._scaled_grouped_mm`` (sm90+, fast accumulation: without it
the input gradient ran at 0.34-0.51x bf16's). Elsewhere the same fp8 values and scales are
widened to fp32 and multiplied there, which is what the CPU tests check against.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch
from torch import Tensor
from torch.autograd import Function

from mega_moe._comm import Group
from mega_moe._gemm import _grouped_wgrad, _offsets, grouped_mm_available
from mega_moe.fp8_rows import Fp8Rows, PaddedRows, aligned_rows, padded_rows, quantize_rows
from mega_moe.wgrad_accum import wgrad_into_main_grad
from mega_tp_layers import WeightGradStore

__all__ = ["fp8_grouped_linear", "fp8_grouped_mm", "fp8_grouped_mm_supported", "fp8_layout"]


def fp8_grouped_mm_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs on ``device`` (CUDA, sm90 and later)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def fp8_grouped_mm(a: Fp8Rows, b: Fp8Rows, ends: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``[M, K]`` rows (groups ending at ``ends``, 16-row multiples) times ``b [L, N, K]``
    transposed per group: ``[M, N]`` in ``out_dtype``, from fp32 accumulation."""
    if a.data.is_cuda:
        out: Tensor = torch._scaled_grouped_mm(
            a.data, b.data.transpose(1, 2), a.inv_scale, b.inv_scale, offs=ends,
            out_dtype=out_dtype, use_fast_accum=True,
        )  # fmt: skip
        return out
    x, w = a.dequantize(), b.dequantize()  # the same values, widened to fp32
    if grouped_mm_available(x, w):
        wide: Tensor = torch._grouped_mm(x, w.transpose(1, 2), offs=ends)
        return wide.to(out_dtype)
    bounds = [0, *ends.tolist()]
    blocks = [x[s:e] @ w[g].t() for g, (s, e) in enumerate(pairwise(bounds))]
    return torch.cat(blocks).to(out_dtype)


def fp8_layout(
    counts: list[int] | Tensor, m: int, device: torch.device, aligned: bool
) -> PaddedRows:
    """Where ``m`` expert-major rows go for the fp8 GEMMs: as they are when ``aligned``
    (every count a multiple of 16, the dispatcher's layout), else padded block by block."""
    return (aligned_rows if aligned else padded_rows)(counts, m, device)


def _gemm(x: Tensor, b: Fp8Rows, layout: PaddedRows, group: Group) -> Tensor:
    """``x [M, K]`` quantised per row (its K sharded over ``group``) times the experts'
    ``b``, through the padded layout, in ``x``'s dtype."""
    padded = layout.scatter(quantize_rows(x, group))  # bench/fp8_expert_parts.py swaps it
    return layout.gather(fp8_grouped_mm(padded, b, layout.ends, x.dtype))


class _Fp8GroupedLinear(Function):
    """fwd: fp8 grouped GEMM · bwd: fp8 input gradient, the weight gradient as the bf16 layer"""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        w: Tensor,
        w_scale: Tensor,
        wt: Tensor,
        wt_scale: Tensor,
        counts: list[int] | Tensor,
        dest: Tensor | None,
        ends: Tensor,
        capacity: int,
        use_grouped_mm: bool,
        groups: tuple[Group, Group],
        wgrad: tuple[Tensor | None, WeightGradStore | None, tuple[Tensor]],
    ) -> Tensor:
        layout = PaddedRows(dest, ends, capacity)  # the tensors apart: Dynamo traces them
        ctx.save_for_backward(x, weight, ends, wt, wt_scale, *([] if dest is None else [dest]),
                              *([counts] if isinstance(counts, Tensor) else []))  # fmt: skip
        ctx.aligned = dest is None
        ctx.host_counts = None if isinstance(counts, Tensor) else counts
        ctx.capacity, ctx.fast, ctx.dgrad_group, ctx.wgrad = (
            layout.capacity,
            use_grouped_mm,
            groups[1],
            wgrad,
        )
        return _gemm(x, Fp8Rows(w, w_scale), layout, groups[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, ends_p, wt, wt_scale, *rest = ctx.saved_tensors
        dest = None if ctx.aligned else rest[0]  # no list.pop: torch 2.11's Dynamo refuses it
        device_counts = rest[0 if ctx.aligned else 1 :]
        counts = device_counts[0] if device_counts else ctx.host_counts
        grad = grad.contiguous()  # [M, N]
        key, store, params = ctx.wgrad
        fast = ctx.fast

        def weight_grad() -> Tensor:
            if key is not None:  # see mega_moe.wgrad_accum: the wrapper drops the tensor
                return wgrad_into_main_grad(grad, x, _offsets(counts, x.device), params[0],
                                            key, fast)  # fmt: skip
            w = _grouped_wgrad(grad, x, counts, fast, weight.shape[0])  # [L, N, K]
            return w.view(params[0].shape).to(params[0].dtype)

        grad_w = None
        if store is not None:  # the weight gradient waits for the W pass
            store.defer(lambda: (weight_grad(),), params)
        elif key is not None:
            grad_w = wgrad_into_main_grad(grad, x, _offsets(counts, x.device), weight, key, fast)
        else:
            grad_w = _grouped_wgrad(grad, x, counts, fast, weight.shape[0]).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            layout = PaddedRows(dest, ends_p, ctx.capacity)
            grad_x = _gemm(grad, Fp8Rows(wt, wt_scale), layout, ctx.dgrad_group)
        return grad_x, grad_w, *([None] * 11)


def fp8_grouped_linear(
    x: Tensor,
    weight: Tensor,
    counts: list[int] | Tensor,
    quantized: tuple[Fp8Rows, Fp8Rows],
    *,
    param: Tensor,
    use_grouped_mm: bool,
    layout: PaddedRows | None = None,
    k_group: Group = None,
    n_group: Group = None,
    into_main: Tensor | None = None,
    store: WeightGradStore | None = None,
) -> Tensor:
    """``[M, K] -> [M, N]``: rows of expert l times ``weight[l].T`` (``weight [L, N, K]``, a
    view of the parameter), forward and input gradient in fp8 with ``quantized``'s
    (forward, input-gradient) operands (:meth:`Fp8ExpertWeights.quantized`).

    ``layout``: the rows' 16-row layout (:func:`fp8_layout`; one for both linears of an
    expert FFN), computed here when not given.
    ``k_group`` / ``n_group``: the group K / N is sharded over (etp), so row scales span it.
    ``use_grouped_mm``: the weight gradient runs ``torch._grouped_mm`` (else a loop).
    ``param``: the parameter ``weight`` is a view of. ``into_main``: the weight gradient goes
    into its ``main_grad`` (:mod:`mega_moe.wgrad_accum`); ``store``: it waits in a zero-bubble
    store for the W pass, which hands it to ``param`` (``weight`` is then detached).
    """
    (w, w_scale), (wt, wt_scale) = quantized
    if layout is None:
        layout = fp8_layout(counts, x.shape[0], x.device, aligned=False)
    if store is not None:  # the parameter in a tuple: an edge would run its accumulator in B
        weight = weight.detach()
    out: Tensor = _Fp8GroupedLinear.apply(
        x, weight, w, w_scale, wt, wt_scale, counts, *layout, use_grouped_mm, (k_group, n_group),
        (into_main, store, (param,)),
    )  # fmt: skip
    return out
