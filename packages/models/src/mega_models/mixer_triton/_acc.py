"""What the mixer kernels accumulate in, and how a reduced dim is cut between programs."""

from __future__ import annotations

from typing import Any

import torch


def accumulation(dtype: torch.dtype) -> tuple[torch.dtype, Any]:
    """Accumulation dtype (torch, triton) for results of ``dtype``: fp64 for fp64, else fp32."""
    import triton.language as tl  # type: ignore[import-untyped]

    if dtype == torch.float64:
        return torch.float64, tl.float64
    return torch.float32, tl.float32


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)


def part_length(n: int, parts: int) -> int:
    """Length of each of about ``parts`` parts of ``n`` items, a multiple of 16. A part is one
    program's share of a weight-gradient sum; each program writes its partial sum, and torch
    adds the partials after: a fixed order, so the same bits on every run (atomics would add
    in whatever order the programs finish)."""
    return 16 * max(1, cdiv(cdiv(n, parts), 16))
