"""A transposed copy of a 2-D fp8 tensor that ``torch.compile`` cannot fuse into its producer.

The weight-gradient GEMM of an fp8 linear needs both operands with the tokens contiguous
(``torch._scaled_mm`` takes only a row-major first and a column-major second operand): the
output gradient and the input are copied transposed. Left to Inductor, the copy fuses into
the kernel that casts the tensor (a norm's, SwiGLU's backward), which then writes one output
row-major and one transposed; on an H100 (2026-12-07) such a forward kernel took 0.35 ms a
call where the bf16 norm alone takes 0.06. :func:`transposed_copy` is an operator of its own:
the producer writes the row-major fp8 tensor only, and a tiled kernel (Triton on CUDA, one
read and one write of the bytes) makes the transposed copy. Whether that is faster is
measured by ``bench/fp8_delayed_parts.py --part opaque-transpose``, which swaps
:func:`row_major_by_kernel` / :func:`col_major_by_kernel` in for
:func:`mega_tp_layers.fp8_gemm.row_major` / ``col_major``; until then the fp8 GEMMs make
plain ``.contiguous()`` copies. On an H100 (2026-12-07) the swap took the delayed-scaling
``1b-bench`` step from 220.5 to 217.3 ms (median) for 5.5 GiB more peak memory, so it stays
an A/B part. Its kernel test (``test_fp8_transpose.py``) passed on an H100 (2026-12-07).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

__all__ = ["col_major_by_kernel", "row_major_by_kernel", "transposed_copy"]


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _kernel_applies(x: Tensor) -> bool:
    if x.element_size() != 1 or x.numel() == 0:
        return False
    if x.device.type == "cpu":  # the interpreter runs CPU tensors, for the tests only
        return os.environ.get("TRITON_INTERPRET") == "1" and _has_triton()
    return x.device.type == "cuda" and _has_triton()


@torch.library.custom_op("mega_tp_layers::transposed_copy", mutates_args=())
def _transposed_copy(x: Tensor) -> Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape[1], x.shape[0], dtype=x.dtype, device=x.device)  # never x
    if not _kernel_applies(x):
        return out.copy_(x.t())
    from mega_tp_layers._transpose_triton import transpose_into

    transpose_into(out.view(torch.uint8), x.view(torch.uint8))
    return out


@_transposed_copy.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty(x.shape[1], x.shape[0])


def transposed_copy(x: Tensor) -> Tensor:
    """``x.T`` as a new row-major tensor, for a 2-D ``x``: exact (bytes are moved, not
    computed), with no gradient, and opaque to ``torch.compile``."""
    if x.dim() != 2:
        raise ValueError(f"transposed_copy takes a 2-D tensor, got shape {tuple(x.shape)}")
    out: Tensor = _transposed_copy(x.detach())
    return out


def row_major_by_kernel(t: Tensor) -> Tensor:
    """``t`` as a row-major tensor; a transposed view of a row-major one (the wgrad GEMM's
    output gradient) is copied by :func:`transposed_copy`."""
    if t.dim() != 2 or t.is_contiguous():
        return t.contiguous()
    if t.t().is_contiguous():
        return transposed_copy(t.t())
    return t.contiguous()


def col_major_by_kernel(t: Tensor) -> Tensor:
    """``t`` as a column-major tensor; a row-major one (the wgrad GEMM's input) is copied by
    :func:`transposed_copy` and viewed transposed."""
    if t.dim() != 2 or t.t().is_contiguous():
        return t.t().contiguous().t()
    if t.is_contiguous():
        return transposed_copy(t).t()
    return t.t().contiguous().t()
