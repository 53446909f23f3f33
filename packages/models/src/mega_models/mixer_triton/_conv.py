"""Causal depthwise conv + SiLU as two torch custom ops (forward, backward) over the Triton
kernels of ``_conv_kernels.py``, the backward registered as the forward's autograd formula.
``torch.compile`` keeps a custom op in its graph as one opaque call (traced through its fake
implementation), so the mixer compiles without a graph break around it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mega_models.mixer_triton._acc import accumulation, cdiv, part_length

#: about this many parts of the sequence per batch row in the backward's weight sums
_PARTS = 8


@torch.library.custom_op("mega_models::causal_conv1d_silu", mutates_args=())
def conv_silu(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x [s, b, g, c]`` (any strides; channel ``i * c + j``), ``weight [g * c, k]``:
    ``silu(conv + bias)``, contiguous, in x's dtype."""
    from mega_models.mixer_triton import _conv_kernels

    s, b, _, cg = x.shape
    ch, k = weight.shape
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out
    _, acc = accumulation(x.dtype)

    def grid(meta: dict[str, int]) -> tuple[int, int, int]:
        return (cdiv(ch, meta["BLOCK_C"]), cdiv(s, meta["BLOCK_S"]), b)

    _conv_kernels.conv_fwd[grid](
        x, weight, weight if bias is None else bias, out, s, cg, ch,
        *x.stride(), *out.stride(), *weight.stride(), HAS_BIAS=bias is not None, K=k, ACC=acc,
    )  # fmt: skip
    return out


@conv_silu.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.empty(x.shape, device=x.device, dtype=x.dtype)


@torch.library.custom_op("mega_models::causal_conv1d_silu_backward", mutates_args=())
def conv_silu_backward(
    dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """``dx`` (contiguous, x's dtype), ``dweight``, ``dbias`` (their parameters' dtypes; the
    weight's when there is no bias, and of no use then): ``dpre`` with the weight and bias
    partial sums, then ``dx`` from ``dpre``."""
    from mega_models.mixer_triton import _conv_kernels

    s, b, _, cg = x.shape
    ch, k = weight.shape
    dy = dy.contiguous()
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    acc_t, acc = accumulation(x.dtype)
    part = part_length(s, _PARTS)
    n_parts = cdiv(s, part)
    alloc = torch.empty if dx.numel() else torch.zeros  # every program writes its partials
    dw = alloc(b * n_parts, ch, k, device=x.device, dtype=acc_t)  # [rows, ch, k]
    db = alloc(b * n_parts, ch, device=x.device, dtype=acc_t)
    if dx.numel():
        dpre = torch.empty((s, b, ch), device=x.device, dtype=acc_t)
        block_k = 1 << (k - 1).bit_length()

        def parts(meta: dict[str, int]) -> tuple[int, int, int]:
            return (cdiv(ch, meta["BLOCK_C"]), n_parts, b)

        _conv_kernels.conv_bwd_dpre[parts](
            x, weight, weight if bias is None else bias, dy, dpre, dw, db, s, cg, ch, part,
            n_parts, *x.stride(), *dy.stride(), *weight.stride(), HAS_BIAS=bias is not None,
            K=k, ACC=acc, BLOCK_K=block_k,
        )  # fmt: skip

        def tiles(meta: dict[str, int]) -> tuple[int, int, int]:
            return (cdiv(ch, meta["BLOCK_C"]), cdiv(s, meta["BLOCK_S"]), b)

        _conv_kernels.conv_bwd_dx[tiles](
            dpre, weight, dx, s, cg, ch, *dx.stride(), *weight.stride(), K=k, ACC=acc,
            BLOCK_K=block_k,
        )  # fmt: skip
    return dx, dw.sum(0).to(weight.dtype), db.sum(0).to(_bias_dtype(weight, bias))


@conv_silu_backward.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    ch = weight.shape[0]
    return (
        torch.empty(x.shape, device=x.device, dtype=x.dtype),
        torch.empty(weight.shape, device=x.device, dtype=weight.dtype),
        torch.empty(ch, device=x.device, dtype=_bias_dtype(weight, bias)),
    )


def _bias_dtype(weight: Tensor, bias: Tensor | None) -> torch.dtype:
    return (weight if bias is None else bias).dtype


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight, bias)


def _backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
    x, weight, bias = ctx.saved_tensors
    dx, dw, db = conv_silu_backward(dy, x, weight, bias)
    return dx, dw, db if bias is not None else None


conv_silu.register_autograd(_backward, setup_context=_setup)
