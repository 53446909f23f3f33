# mypy: ignore-errors
"""The one-pass row-wise e4m3 quantiser behind :func:`mega_moe.fp8_rows.quantize_rows_2d`.

One program per row: the row (up to ``MAX_COLS`` columns) is loaded once into registers,
its amax reduced there, and the scaled, clamped values stored as e4m3 with the row's
inverse scale. The arithmetic is the torch path's, operation for operation (``448 / amax``
as torch computes it, a reciprocal then a product; IEEE division by ``div_rn``;
round-to-nearest casts), so on the GPU the bytes should be the same (the CPU test sees
Triton's interpreter, whose e4m3 cast rounds otherwise).
Imported only when called, so the package never needs triton.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from mega_moe.fp8_rows import ROW_KERNEL_MAX_COLS

__all__ = ["MAX_COLS", "quantize_rows_into"]

#: the widest row one program holds (8 KiB of bf16 in registers over 8 warps)
MAX_COLS = ROW_KERNEL_MAX_COLS


@triton.jit
def _rowquant_kernel(x_ptr, q_ptr, s_ptr, K, FMAX: tl.constexpr, EPS: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    # torch divides a number by a tensor as reciprocal-then-multiply: two roundings, kept
    scale = FMAX * tl.math.div_rn(1.0, tl.maximum(amax, EPS))
    q = tl.minimum(tl.maximum(x * scale, -FMAX), FMAX)
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, tl.math.div_rn(1.0, scale))


def quantize_rows_into(q: Tensor, inv_scale: Tensor, x: Tensor, fmax: float, eps: float) -> None:
    """``q[r] = e4m3(x[r] * s_r)``, ``inv_scale[r] = 1 / s_r``, ``s_r = fmax / max(amax_r, eps)``
    for a contiguous ``x [R, K]`` (``K <= MAX_COLS``)."""
    rows, k = x.shape
    block = triton.next_power_of_2(k)
    warps = 8 if block >= 2048 else 4
    _rowquant_kernel[(rows,)](x, q, inv_scale, k, FMAX=fmax, EPS=eps, BLOCK=block,
                              num_warps=warps)  # fmt: skip
