"""The chunked SSD scan (Mamba-2) in the project's own Triton kernels, forward and backward:
``ssd_triton`` computes what ``mega_models.ssd.ssd_chunked`` computes (plus an optional
``D`` skip), on CUDA tensors, or on CPU ones under the Triton interpreter
(``TRITON_INTERPRET=1`` set before triton is first imported: the interpreter swaps
triton's own library functions at its import).

Triton is optional: ``import mega_models`` never imports it; ``triton_available()`` says
whether it can be.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["ssd_triton", "triton_available"]


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (importable)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _scan_disabled() -> Callable[..., Tensor]:
    """The scan kept out of dynamo (its kernels launch eagerly); wrapped on first use, as
    ``torch.compiler.disable`` imports dynamo."""
    from mega_models.ssd_triton._function import ssd_scan

    disabled: Callable[..., Tensor] = torch.compiler.disable(ssd_scan)  # type: ignore[no-untyped-call]
    return disabled


def ssd_triton(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
) -> Tensor:
    """``ssd_chunked(x, dt, A, B, C, chunk_size) + x * D[:, None]`` (no skip when ``D`` is
    None): ``x [l, b, h, p]``, ``dt [l, b, h]`` (the step after softplus and clamping),
    ``A [h]``, ``B``/``C [l, b, g, n]``; output ``[l, b, h, p]`` in x's dtype.

    Accumulates in fp32 (fp64 for fp64 inputs); matmul operands are in x's dtype (B and C
    are cast to it, the fp32 states too), so bf16 inputs multiply in bf16 on the tensor
    cores, and fp32 ones in full fp32 (never TF32).
    """
    if torch.compiler.is_compiling():
        return _scan_disabled()(x, dt, A, B, C, chunk_size, D)
    from mega_models.ssd_triton._function import ssd_scan

    return ssd_scan(x, dt, A, B, C, chunk_size, D)
