"""RMSNorm and LayerNorm whose parameters are replicated over tp.

Under :func:`mega_tp_layers.defer_weight_grads` a norm's backward is split: ``B`` gives
the input gradient and the weight (and bias) gradients, ``sum(dy * x_hat)`` and ``sum(dy)``
over the tokens, are left in the store for its ``W`` pass. Both are aten's fused norm
backward with the other half masked off, run from the input, output gradient and the
statistics the forward saved, so B costs what the fused backward's input path costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function
from torch.distributed import ProcessGroup

from mega_tp_layers import (
    INIT_ATTR,
    KeepsParamAttrs,
    WeightGradStore,
    Zeros,
    current_weight_grad_store,
    mark_replicated,
    mark_sequence_parallel,
)

__all__ = ["Norm", "Ones"]


@dataclass(frozen=True)
class Ones:
    """Fills with ones (norm scales)."""

    def __call__(self, full: Tensor, generator: torch.Generator) -> None:
        full.fill_(1.0)


def _fused_rms_backward(x: Tensor) -> bool:
    """Whether aten's fused RMSNorm backward kernel runs on ``x``'s device (CUDA, torch 2.9+)."""
    return x.device.type == "cuda" and hasattr(torch.ops.aten, "_fused_rms_norm_backward")


def _rms_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``F.rms_norm`` and its ``1/sigma`` per token (fp32 for low-precision inputs)."""
    shape = [x.shape[-1]]
    if hasattr(torch.ops.aten, "_fused_rms_norm"):  # what F.rms_norm runs, with its rstd
        out, rstd = torch.ops.aten._fused_rms_norm(x, shape, weight, eps)
        return out, rstd
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return F.rms_norm(x, shape, weight, eps), rstd


def _rms_x_hat(x: Tensor, rstd: Tensor) -> Tensor:
    """The normalised input ``x / sigma`` from the forward's saved ``rstd``, in fp32 at least."""
    return x.to(torch.promote_types(x.dtype, rstd.dtype)) * rstd


def _rms_dgrad(grad: Tensor, x: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    """RMSNorm's input gradient alone: aten's fused kernel where it runs, else 7 ops in fp32.

    ``dx = rstd * (g - x_hat * mean(g * x_hat))`` with ``g = dy * w``: the same count of
    full-size ops as autograd through ``F.rms_norm``'s CPU composite, nothing recomputed.
    """
    if _fused_rms_backward(x):
        dx: Tensor = torch.ops.aten._fused_rms_norm_backward(
            grad, x, [x.shape[-1]], rstd, weight, [True, False]
        )[0]
        return dx
    x_hat = _rms_x_hat(x, rstd)
    g = grad.to(x_hat.dtype) * weight.to(x_hat.dtype)  # d loss / d x_hat
    dx = g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True)
    return (dx * rstd).to(x.dtype)


def _rms_wgrad(grad: Tensor, x: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    """RMSNorm's weight gradient ``sum(dy * x_hat)`` over the tokens, accumulated in fp32."""
    if _fused_rms_backward(x):
        dw: Tensor = torch.ops.aten._fused_rms_norm_backward(
            grad, x, [x.shape[-1]], rstd, weight, [False, True]
        )[1]
        return dw
    x_hat = _rms_x_hat(x, rstd).reshape(-1, x.shape[-1])  # [tokens, h]
    g = grad.reshape(-1, grad.shape[-1]).to(x_hat.dtype)
    return (g * x_hat).sum(dim=0).to(weight.dtype)


def _norm(x: Tensor, kind: str, eps: float, weight: Tensor, bias: Tensor | None) -> Tensor:
    if kind == "rmsnorm":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class _SplitNorm(Function):
    """fwd: the fused norm · bwd: input gradient now, weight/bias gradients queued in the store

    Both halves run aten's fused backward (``native_layer_norm_backward``, and on CUDA
    ``_fused_rms_norm_backward``) with the other half's outputs masked off, from the
    statistics forward saved (``rstd``, and LayerNorm's mean): B costs what the fused
    backward's input path costs, and W one pass over ``(x, dy)``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        kind: str,
        eps: float,
        params: tuple[Tensor, Tensor | None],
        store: WeightGradStore,
    ) -> Tensor:
        ctx.kind, ctx.params, ctx.store = kind, params, store
        if kind == "rmsnorm":
            out, rstd = _rms_forward(x, weight, eps)
            ctx.save_for_backward(x, weight, rstd)
            return out
        ln_out, mean, rstd = torch.ops.aten.native_layer_norm(x, [x.shape[-1]], weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        result: Tensor = ln_out
        return result

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        need_x = ctx.needs_input_grad[0]
        if ctx.kind == "rmsnorm":
            x, weight, rstd = ctx.saved_tensors
            ctx.store.defer(lambda: (_rms_wgrad(grad, x, rstd, weight), None), ctx.params)
            dx_rms = _rms_dgrad(grad, x, rstd, weight) if need_x else None
            return dx_rms, None, None, None, None, None, None
        x, weight, bias, mean, rstd = ctx.saved_tensors
        shape, with_bias = [x.shape[-1]], bias is not None
        backward = torch.ops.aten.native_layer_norm_backward

        def wgrad() -> tuple[Tensor | None, ...]:
            _, dw, db = backward(grad, x, shape, mean, rstd, weight, bias, [False, True, with_bias])
            return dw, db

        ctx.store.defer(wgrad, ctx.params)
        if not need_x:
            return (None,) * 7
        dx: Tensor = backward(grad, x, shape, mean, rstd, weight, bias, [True, False, False])[0]
        return dx, None, None, None, None, None, None


class Norm(KeepsParamAttrs):
    """``rmsnorm`` or ``layernorm`` over the last dimension, parameters replicated over tp.

    ``partial_grads`` marks the parameters whose gradient is partial on each tp rank —
    under sequence parallelism (each rank normalises a slice of the sequence), or for a
    QK-norm shared by heads split over tp — so that
    :func:`mega_tp_layers.sync_sequence_parallel_grads` sums them over tp. Inside
    :func:`mega_tp_layers.defer_weight_grads` the weight gradients wait for the W pass.
    """

    def __init__(
        self,
        size: int,
        kind: str,
        eps: float,
        *,
        tp_group: ProcessGroup,
        partial_grads: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.kind, self.eps, self.size = kind, eps, size
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        setattr(self.weight, INIT_ATTR, Ones())
        self.bias: nn.Parameter | None = None
        if kind == "layernorm":
            self.bias = nn.Parameter(torch.zeros(size, device=device, dtype=dtype))
            setattr(self.bias, INIT_ATTR, Zeros())
        for p in self.parameters():
            mark_replicated(p, tp_group)
            if partial_grads:
                mark_sequence_parallel(p)

    def forward(self, x: Tensor) -> Tensor:
        store = current_weight_grad_store()
        if store is None or not self.weight.requires_grad:
            return _norm(x, self.kind, self.eps, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        params = (self.weight, self.bias)
        out: Tensor = _SplitNorm.apply(
            x, self.weight.detach(), bias, self.kind, self.eps, params, store
        )
        return out
