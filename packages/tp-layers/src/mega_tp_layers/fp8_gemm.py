"""FP8 tensors, their tensor-wise quantisation and the scaled GEMM that multiplies them.

:func:`fp8_quantize` scales a tensor by its amax (all-reduced over the group it is a shard
of); :func:`scaled_gemm` multiplies two :class:`Fp8Tensor` with an fp32 accumulator and both
inverse scales, by ``torch._scaled_mm`` on CUDA sm89+ or by an exact fp32 emulation
elsewhere. ``mega_tp_layers.fp8`` builds a linear layer's three GEMMs from these.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from mega_tp_layers._comm import all_reduce_max, group_size
from mega_tp_layers.fp8_scaling import as_dtype

if TYPE_CHECKING:
    from mega_tp_layers.fp8_recipe import Fp8Recipe

__all__ = [
    "FP8_ALIGNMENT",
    "FP8_DTYPES",
    "Fp8Tensor",
    "col_major",
    "fp8_gemm_fits",
    "fp8_gemm_supported",
    "fp8_quantize",
    "fp8_quantize_by_amax",
    "row_major",
    "scaled_gemm",
    "warn_unaligned",
]

#: ``torch._scaled_mm`` needs every GEMM dimension to be a multiple of this.
FP8_ALIGNMENT = 16

#: The fp8 formats a recipe may name.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class Fp8Tensor(NamedTuple):
    """An fp8 tensor and its fp32 scalar inverse scale: ``data.float() * inv_scale ~ x``."""

    data: Tensor
    inv_scale: Tensor
    col_major: Tensor | None = None
    """``data``'s values stored column-major (a transposed copy kept by its owner, e.g. a
    weight cache), which a GEMM taking this tensor as its second operand then need not make."""

    def dequantize(self) -> Tensor:
        """The fp32 values this tensor stands for."""
        return self.data.float() * self.inv_scale


def fp8_gemm_supported(device: torch.device) -> bool:
    """True when ``torch._scaled_mm`` runs on ``device`` (CUDA, compute capability >= 8.9)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_gemm_fits(*dims: int) -> bool:
    """True when every GEMM dimension is a multiple of :data:`FP8_ALIGNMENT`."""
    return all(d % FP8_ALIGNMENT == 0 for d in dims)


def fp8_quantize(
    x: Tensor, dtype: torch.dtype, eps: float = 1e-12, group: ProcessGroup | None = None
) -> Fp8Tensor:
    """``x`` in the fp8 ``dtype`` with one scale for the whole tensor (its current amax).

    With ``group``, ``x`` is this rank's shard of a tensor split over the group: the amax
    is the max over every rank's shard (one scalar all-reduce, no host sync), so each shard
    is quantised exactly as the whole tensor would be.
    """
    if dtype not in FP8_DTYPES:
        raise ValueError(
            f"fp8_quantize dtype ({dtype}) is not an fp8 format; "
            "use torch.float8_e4m3fn or torch.float8_e5m2"
        )
    x32 = x.detach().float()
    amax = x32.abs().amax()
    if group is not None and group_size(group) > 1:
        all_reduce_max(amax, group)  # the whole tensor's amax
    return fp8_quantize_by_amax(x32, amax, dtype, eps)


def fp8_quantize_by_amax(
    x: Tensor, amax: Tensor, dtype: torch.dtype, eps: float = 1e-12
) -> Fp8Tensor:
    """``x`` in the fp8 ``dtype`` with the scale of a given ``amax`` (an fp32 scalar tensor).

    The amax may be that of a larger tensor ``x`` is part of (e.g. reduced over ranks), so
    that slices quantised apart get the values quantising the whole would give.
    """
    fmax = torch.finfo(dtype).max
    scale = fmax / amax.float().clamp(min=eps)  # fp32 scalar, on x's device
    data = (x.detach().float() * scale).clamp(-fmax, fmax).to(dtype)
    return Fp8Tensor(data, scale.reciprocal())


def row_major(t: Tensor) -> Tensor:
    """``t`` as a row-major tensor (itself when it is one); looked up by :func:`scaled_gemm`
    at call time (``bench/fp8_delayed_parts.py --part opaque-transpose`` swaps in
    :func:`mega_tp_layers.fp8_transpose.row_major_by_kernel`)."""
    return t.contiguous()


def col_major(t: Tensor) -> Tensor:
    """``t`` as a column-major tensor of the same shape (itself when it is one)."""
    return t.t().contiguous().t()


def scaled_gemm(
    a: Fp8Tensor,
    b: Fp8Tensor,
    out_dtype: torch.dtype,
    recipe: Fp8Recipe,
    *,
    forward: bool = False,
) -> Tensor:
    """``dequant(a) @ dequant(b)`` for ``a`` ``[M, K]`` and ``b`` ``[K, N]``, in ``out_dtype``.

    ``forward``: a forward GEMM, which accumulates fast if ``recipe.fast_accum_forward``.
    """
    device = a.data.device
    if recipe.emulated_on(device):
        acc = a.data.float() @ b.data.float()  # products of fp8 values are exact in fp32
        return as_dtype(acc * (a.inv_scale * b.inv_scale), out_dtype)
    if not fp8_gemm_supported(device):
        raise ValueError(
            f"Fp8Recipe(emulate=False) needs a CUDA device of compute capability 8.9 or newer "
            f"for torch._scaled_mm, but the tensors are on {device}; use emulate=None (auto)"
        )
    # _scaled_mm wants a row-major, b column-major: both copies are no-ops when already so
    b_data = b.col_major if b.col_major is not None else col_major(b.data)
    out: Tensor = torch._scaled_mm(
        row_major(a.data),
        b_data,
        scale_a=a.inv_scale,
        scale_b=b.inv_scale,
        out_dtype=out_dtype,
        use_fast_accum=forward and recipe.fast_accum_forward,
    )
    return out


@functools.cache
def warn_unaligned(what: str, dims: tuple[int, ...]) -> None:
    warnings.warn(
        f"fp8 {what} GEMM of dims {dims} is not a multiple of {FP8_ALIGNMENT} in every "
        "dimension, as torch._scaled_mm needs; it runs in high precision instead",
        stacklevel=3,
    )
