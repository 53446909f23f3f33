"""Dynamic loss scaling for fp16 training: back off on overflow, grow after a run of good steps."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler:
    """Scale the loss so fp16 gradients neither underflow nor overflow.

    The loss is multiplied by :attr:`scale` before backward and the gradients divided by it
    before the step. A step whose gradients hold inf or NaN is skipped; from the
    ``hysteresis``-th such step since the scale last grew, each one multiplies the scale by
    ``backoff_factor``. After ``growth_interval`` consecutive good steps the scale is
    multiplied by ``growth_factor``.
    The scale stays within ``[min_scale, max_scale]``.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> None:
        if not 0 < min_scale <= initial_scale <= max_scale:
            raise ValueError(
                f"the loss scales must satisfy 0 < min_scale ({min_scale}) <= initial_scale "
                f"({initial_scale}) <= max_scale ({max_scale}); adjust them"
            )
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError(
                f"growth_factor ({growth_factor}) must exceed 1 and backoff_factor "
                f"({backoff_factor}) must lie strictly between 0 and 1"
            )
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(
                f"growth_interval ({growth_interval}) and hysteresis ({hysteresis}) must be "
                "at least 1"
            )
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.max_scale = max_scale
        self._scale = float(initial_scale)
        self._good_steps = 0
        self._hysteresis_left = hysteresis

    @property
    def scale(self) -> float:
        """The factor the loss is multiplied by."""
        return self._scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``: call backward on this."""
        return loss * self._scale

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step (``found_inf``: the step was skipped)."""
        if found_inf:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self._good_steps = 0
            self._hysteresis_left = self.hysteresis
            self._scale = min(self._scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, plain Python values."""
        return {
            "scale": self._scale,
            "good_steps": self._good_steps,
            "hysteresis_left": self._hysteresis_left,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`."""
        self._scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
