"""RMSNorm and LayerNorm whose parameters are replicated over tp.

Under :func:`mega_tp_layers.defer_weight_grads` a norm's backward is split: ``B`` gives
the input gradient (from the normalised input and the weight) and the weight (and bias)
gradients, ``sum(dy * x_hat)`` and ``sum(dy)`` over the tokens, are left in the store for
its ``W`` pass, computed from the saved input and output gradient.
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


def _normalised(x: Tensor, kind: str, eps: float) -> tuple[Tensor, Tensor]:
    """``x_hat`` and ``1/sigma`` of ``x`` over its last dim, in fp32 at least."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    if kind == "layernorm":
        x = x - x.mean(dim=-1, keepdim=True)
        var = x.square().mean(dim=-1, keepdim=True)
    else:
        var = x.square().mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    return x * rstd, rstd


def _norm(x: Tensor, kind: str, eps: float, weight: Tensor, bias: Tensor | None) -> Tensor:
    if kind == "rmsnorm":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class _SplitNorm(Function):
    """fwd: the fused norm · bwd: input gradient now, weight/bias gradients queued in the store"""

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
        ctx.save_for_backward(x, weight)
        ctx.kind, ctx.eps, ctx.params, ctx.store = kind, eps, params, store
        return _norm(x, kind, eps, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        kind, eps, params = ctx.kind, ctx.eps, ctx.params

        def wgrad() -> tuple[Tensor | None, ...]:
            x_hat = _normalised(x, kind, eps)[0].reshape(-1, x.shape[-1])  # [tokens, h]
            g = grad.reshape(-1, grad.shape[-1]).to(x_hat.dtype)
            dw = (g * x_hat).sum(dim=0).to(weight.dtype)
            db = g.sum(dim=0).to(weight.dtype) if params[1] is not None else None
            return dw, db

        ctx.store.defer(wgrad, params)
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        x_hat, rstd = _normalised(x, kind, eps)
        g = grad.to(x_hat.dtype) * weight.to(x_hat.dtype)  # d loss / d x_hat
        # d x_hat/d x projects out the directions the normalisation removes
        dx = g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True)
        if kind == "layernorm":
            dx = dx - g.mean(dim=-1, keepdim=True)
        return (dx * rstd).to(x.dtype), None, None, None, None, None, None


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
