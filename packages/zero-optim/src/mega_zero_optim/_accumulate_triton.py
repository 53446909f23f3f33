# mypy: ignore-errors
"""The streaming kernel behind :func:`~mega_zero_optim.accumulate.accumulate_grad`.

One program per ``BLOCK`` elements of the flat pair: load the gradient, widen it to fp32,
multiply by ``alpha`` (skipped when 1), add the fp32 main gradient unless this is the
step's first, store. Imported only when called, so the package never needs triton.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["accumulate"]

#: Elements a program: 16 KiB of fp32 a program, 8 warps, each thread 16 elements
#: (vectorised 16-byte loads and stores).
BLOCK = 4096


@triton.jit
def _accumulate_kernel(
    main_ptr, grad_ptr, n, alpha, FIRST: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(grad_ptr + offs, mask=mask, eviction_policy="evict_first").to(tl.float32)
    if SCALE:
        g = g * alpha
    if not FIRST:
        g = g + tl.load(main_ptr + offs, mask=mask, eviction_policy="evict_first")
    tl.store(main_ptr + offs, g, mask=mask)


def accumulate(main: Tensor, grad: Tensor, alpha: float, first: bool) -> None:
    """``main += alpha * grad`` (``main = alpha * grad`` when ``first``): contiguous, fp32
    ``main``, a ``grad`` of the same shape on the same device."""
    n = main.numel()
    _accumulate_kernel[(triton.cdiv(n, BLOCK),)](
        main, grad, n, float(alpha), FIRST=first, SCALE=alpha != 1.0, BLOCK=BLOCK, num_warps=8
    )
