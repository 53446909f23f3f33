"""Rotary position embedding (rotate-half convention) on sequence-first activations, with
DeepSeek's YaRN frequency interpolation for extended contexts.

Layout: a head's rotated width ``d`` is two halves, element ``i`` paired with ``i + d/2``
(Llama's "rotate half"). DeepSeek's checkpoints pair neighbours ``(2i, 2i + 1)`` instead
(transformers' ``rope_interleave``); both give the same scores once the rope rows of the
weights are permuted evens-then-odds, which is how a Hugging Face bridge maps them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from mega_models.attention_config import yarn_mscale

if TYPE_CHECKING:
    from mega_models.config import GPTConfig

__all__ = ["apply_rope", "rope_for", "rope_tables", "yarn_inv_freq"]


def _inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    return 1.0 / theta**exponents


def yarn_inv_freq(
    head_dim: int,
    theta: float,
    factor: float,
    original_max_position: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    device: torch.device | None = None,
) -> torch.Tensor:
    """YaRN's ``[head_dim / 2]`` inverse frequencies: the fast ones (more than ``beta_fast``
    turns over the original context) kept, the slow ones (under ``beta_slow``) divided by
    ``factor``, a linear ramp between (over integer-rounded band edges, as DeepSeek's)."""
    dev = torch.device("cpu") if device is None else device
    plain = _inv_freq(head_dim, theta, dev)

    def band_edge(turns: float) -> float:  # the dim index that turns this often
        ratio = original_max_position / (turns * 2 * math.pi)
        return head_dim * math.log(ratio) / (2 * math.log(theta))

    low = max(math.floor(band_edge(beta_fast)), 0)
    high = min(math.ceil(band_edge(beta_slow)), head_dim - 1)
    span = high - low if high > low else 0.001
    ramp = ((torch.arange(head_dim // 2, device=dev, dtype=torch.float32) - low) / span).clamp(0, 1)
    return plain / factor * ramp + plain * (1 - ramp)


def rope_tables(
    head_dim: int,
    positions: torch.Tensor,
    theta: float,
    dtype: torch.dtype,
    *,
    inv_freq: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[s, 1, 1, head_dim]`` for the given absolute positions ``[s]``,
    or ``[s, b, 1, head_dim]`` for positions per sample ``[s, b]`` (packed documents).

    Positions are explicit so that context-parallel ranks, which hold non-contiguous
    chunks of the sequence, rotate by their tokens' true positions. ``inv_freq``
    (``[head_dim / 2]``) replaces the plain frequencies; ``scale`` multiplies both tables.
    """
    if inv_freq is None:
        inv_freq = _inv_freq(head_dim, theta, positions.device)
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)  # [s(, b), d/2] -> [s(, b), d]
    cos, sin = angles.cos() * scale, angles.sin() * scale
    shape = (positions.shape[0], -1, 1, head_dim)  # -> [s, 1 or b, 1, d]
    return cos.to(dtype).view(shape), sin.to(dtype).view(shape)


def rope_for(
    config: GPTConfig, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The model's rope tables (``config.rope_dim`` wide, YaRN-scaled when the config says
    so), or None when its position encoding is not rope."""
    c = config
    if c.position != "rope":
        return None
    if c.rope_scaling_factor is None or c.rope_original_max_position is None:
        return rope_tables(c.rope_dim, positions, c.rope_theta, dtype)
    factor = c.rope_scaling_factor
    inv_freq = yarn_inv_freq(
        c.rope_dim, c.rope_theta, factor, c.rope_original_max_position,
        c.rope_beta_fast, c.rope_beta_slow, device=positions.device,
    )  # fmt: skip
    scale = yarn_mscale(factor)
    if c.rope_mscale and c.rope_mscale_all_dim:
        scale = yarn_mscale(factor, c.rope_mscale) / yarn_mscale(factor, c.rope_mscale_all_dim)
    return rope_tables(c.rope_dim, positions, c.rope_theta, dtype, inv_freq=inv_freq, scale=scale)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, n, d]`` by the tables of :func:`rope_tables`."""
    # chunk, not slicing: its backward is one concatenation, where two slices' backwards
    # would each fill a zero tensor of x's size and then be added
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x * cos + rotated * sin
