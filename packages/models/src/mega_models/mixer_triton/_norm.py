"""Gated RMSNorm as two torch custom ops (forward, backward) over the Triton kernels of
``_norm_kernels.py``, the backward registered as the forward's autograd formula (see
``_conv.py`` for why custom ops)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mega_models.mixer_triton._acc import accumulation, cdiv, part_length

#: about this many parts of the rows per group in the backward's weight sum
_PARTS = 128


def _out_dtype(y: Tensor, z: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype ``rms_norm(y * silu(z)) * weight`` has in torch."""
    return torch.promote_types(torch.promote_types(y.dtype, z.dtype), weight.dtype)


def _rows(t: Tensor) -> Tensor:
    """``[.., g, w] -> [rows, g, w]`` (a view where the leading dims allow it)."""
    return t.reshape(-1, t.shape[-2], t.shape[-1])


@torch.library.custom_op("mega_models::gated_rms_norm", mutates_args=())
def gated_norm(y: Tensor, z: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``y``, ``z`` ``[.., g, w]`` (any strides), ``weight [g * w]``: the normed output
    (contiguous) and each row's ``rstd`` ``[.., g]`` (fp32; fp64 for fp64)."""
    from mega_models.mixer_triton import _norm_kernels

    dtype = _out_dtype(y, z, weight)
    acc_t, acc = accumulation(dtype)
    out = torch.empty(y.shape, device=y.device, dtype=dtype)
    rstd = torch.empty(y.shape[:-1], device=y.device, dtype=acc_t)
    if out.numel() == 0:
        return out, rstd
    y3, z3, out3 = _rows(y), _rows(z), _rows(out)
    rows, g, w = y3.shape
    eps_t = torch.full((1,), eps, device=y.device, dtype=acc_t)  # exact: a float arg is fp32

    def grid(meta: dict[str, int]) -> tuple[int, int]:
        return (g, cdiv(rows, meta["BLOCK_R"]))

    _norm_kernels.norm_fwd[grid](
        y3, z3, weight, eps_t, out3, rstd, rows, g, w,
        *y3.stride(), *z3.stride(), *out3.stride(), ACC=acc, BLOCK_W=1 << (w - 1).bit_length(),
    )  # fmt: skip
    return out, rstd


@gated_norm.register_fake
def _(y: Tensor, z: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    dtype = _out_dtype(y, z, weight)
    rstd_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return (
        torch.empty(y.shape, device=y.device, dtype=dtype),
        torch.empty(y.shape[:-1], device=y.device, dtype=rstd_dtype),
    )


@torch.library.custom_op("mega_models::gated_rms_norm_backward", mutates_args=())
def gated_norm_backward(
    dout: Tensor, y: Tensor, z: Tensor, weight: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``dy``, ``dz`` (contiguous, in y's and z's dtypes) and ``dweight``."""
    from mega_models.mixer_triton import _norm_kernels

    dout = dout.contiguous()
    dy = torch.empty(y.shape, device=y.device, dtype=y.dtype)
    dz = torch.empty(z.shape, device=z.device, dtype=z.dtype)
    acc_t, acc = accumulation(dout.dtype)
    y3, z3, d3 = _rows(y), _rows(z), _rows(dout)
    rows, g, w = y3.shape
    part = part_length(rows, _PARTS)
    n_parts = cdiv(rows, part)
    alloc = torch.empty if dy.numel() else torch.zeros  # every program writes its partial
    dw = alloc(n_parts, g * w, device=y.device, dtype=acc_t)
    if dy.numel():
        _norm_kernels.norm_bwd[(g, n_parts)](
            y3, z3, weight, rstd, d3, _rows(dy), _rows(dz), dw, rows, g, w, part,
            *y3.stride(), *z3.stride(), *d3.stride(), ACC=acc,
            BLOCK_W=1 << (w - 1).bit_length(),
        )  # fmt: skip
    return dy, dz, dw.sum(0).to(weight.dtype)


@gated_norm_backward.register_fake
def _(
    dout: Tensor, y: Tensor, z: Tensor, weight: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    return (
        torch.empty(y.shape, device=y.device, dtype=y.dtype),
        torch.empty(z.shape, device=z.device, dtype=z.dtype),
        torch.empty(weight.shape, device=weight.device, dtype=weight.dtype),
    )


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    y, z, weight, _ = inputs
    ctx.save_for_backward(y, z, weight, output[1])
    ctx.mark_non_differentiable(output[1])


def _backward(ctx: Any, dout: Tensor, _drstd: Tensor | None) -> tuple[Tensor | None, ...]:
    y, z, weight, rstd = ctx.saved_tensors
    dy, dz, dw = gated_norm_backward(dout, y, z, weight, rstd)
    return dy, dz, dw, None


gated_norm.register_autograd(_backward, setup_context=_setup)
