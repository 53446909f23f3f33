# mypy: ignore-errors
"""The tiled transpose behind :func:`~mega_tp_layers.fp8_transpose.transposed_copy`.

One program per ``BM x BN`` tile of the ``[M, N]`` row-major input: a coalesced load along
``N``, the tile transposed in registers and shared memory, a coalesced store along ``M``
into the ``[N, M]`` row-major output. Bytes are moved as they are (fp8 as uint8), so the
copy is exact. Imported only when called, so the package never needs triton.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["transpose_into"]

#: tile edge: 64 x 64 one-byte elements, 4 KiB a program, 4 warps
BLOCK = 64


@triton.jit
def _transpose_kernel(x_ptr, y_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rn = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tile = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask)
    tl.store(y_ptr + rn[:, None] * M + rm[None, :], tl.trans(tile), mask=tl.trans(mask))


def transpose_into(out: Tensor, x: Tensor) -> None:
    """``out[:] = x.T`` for a row-major ``x`` ``[M, N]`` and a row-major ``out`` ``[N, M]``
    of the same element size (views of the same bytes, e.g. uint8 for fp8)."""
    m, n = x.shape
    grid = (triton.cdiv(m, BLOCK), triton.cdiv(n, BLOCK))
    _transpose_kernel[grid](x, out, m, n, BM=BLOCK, BN=BLOCK, num_warps=4)
