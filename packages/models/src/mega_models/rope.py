"""Rotary position embedding (rotate-half convention) on sequence-first activations."""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rope_tables"]


def rope_tables(
    head_dim: int, positions: torch.Tensor, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[s, 1, 1, head_dim]`` for the given absolute positions ``[s]``.

    Positions are explicit so that context-parallel ranks, which hold non-contiguous
    chunks of the sequence, rotate by their tokens' true positions.
    """
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    )
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [s, d/2]
    angles = torch.cat([angles, angles], dim=-1)  # [s, d]
    return angles.cos().to(dtype)[:, None, None, :], angles.sin().to(dtype)[:, None, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, n, d]`` by the tables of :func:`rope_tables`."""
    # chunk, not slicing: its backward is one concatenation, where two slices' backwards
    # would each fill a zero tensor of x's size and then be added
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x * cos + rotated * sin
