"""The grouped expert GEMM whose weight gradient goes straight into ``main_grad``.

Forward as :func:`mega_moe._gemm.grouped_linear`; backward computes the input gradient
(one grouped GEMM against the weights) and adds ``alpha * dy_l^T x_l`` into the weight's
fp32 ``main_grad`` (:func:`mega_moe.wgrad_accum.wgrad_into_main_grad`, which finds it by the
key the layer registered), handing autograd an uninitialised tensor for the weight so that
its accumulator and the data-parallel wrapper's hook still run (the wrapper, having offered
the fusion, does not add it). See :mod:`mega_moe.wgrad_accum` for the protocol.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.autograd import Function

from mega_moe._gemm import _offsets, grouped_linear
from mega_moe.wgrad_accum import wgrad_into_main_grad

__all__ = ["main_grad_grouped_linear"]


class _MainGradGroupedLinear(Function):
    """fwd: :func:`grouped_linear` · bwd: input gradient, weight gradient into ``main_grad``"""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        counts: list[int] | Tensor,
        ends: Tensor,
        use_grouped_mm: bool,
        key: Tensor,
    ) -> Tensor:
        host = None if isinstance(counts, Tensor) else counts
        ctx.save_for_backward(x, weight, ends, key, *([] if host is not None else [counts]))
        ctx.host_counts, ctx.fast = host, use_grouped_mm
        return grouped_linear(x, weight, counts, use_grouped_mm)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, ends, key, *device_counts = ctx.saved_tensors
        counts = device_counts[0] if device_counts else ctx.host_counts
        grad = grad.contiguous()  # [M, out]
        grad_w = wgrad_into_main_grad(grad, x, ends, weight, key, ctx.fast)
        grad_x = None
        if ctx.needs_input_grad[0]:  # [M, out] -> [M, in]: rows of expert l times weight[l]
            grad_x = grouped_linear(grad, weight.transpose(1, 2), counts, ctx.fast)
        return grad_x, grad_w, None, None, None, None


def main_grad_grouped_linear(
    x: Tensor, weight: Tensor, counts: list[int] | Tensor, use_grouped_mm: bool, key: Tensor
) -> Tensor:
    """:func:`grouped_linear` of ``x [M, in]`` and ``weight [L, out, in]`` whose backward
    adds the weight gradient into the ``main_grad`` registered under ``key``."""
    ends = _offsets(counts, x.device)
    out: Tensor = _MainGradGroupedLinear.apply(x, weight, counts, ends, use_grouped_mm, key)
    return out
