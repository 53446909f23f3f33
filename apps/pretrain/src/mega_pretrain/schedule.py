"""Learning-rate schedules: linear warm-up, then cosine, linear, warmup-stable-decay or constant."""

from __future__ import annotations

import math

__all__ = ["lr_at"]


def lr_at(
    step: int,
    *,
    lr: float,
    min_lr: float,
    warmup_steps: int,
    total_steps: int,
    decay: str = "cosine",
    wsd_decay_fraction: float = 0.2,
) -> float:
    """The learning rate of optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay == "constant":
        return lr
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    if decay == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if decay == "linear":
        return lr + (min_lr - lr) * progress
    if decay == "wsd":
        start = 1.0 - wsd_decay_fraction
        if progress <= start:
            return lr
        return lr + (min_lr - lr) * (progress - start) / max(wsd_decay_fraction, 1e-12)
    raise ValueError(f"decay ({decay!r}) must be one of cosine, linear, wsd, constant")
