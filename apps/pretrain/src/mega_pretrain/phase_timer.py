"""Where a step's time goes: data, forward-backward, optimizer, checkpoint (ms per step).

The training loop wraps each phase of a step in :meth:`PhaseTimer.phase` and, at each log
interval, :meth:`PhaseTimer.take` turns the sums into milliseconds per step over the
interval (``data_ms``, ``fwd_bwd_ms``, ``optim_ms``, ``ckpt_ms``), logged beside ``step_ms``.
The phases are disjoint parts of the interval, so their sum is at most ``step_ms``; the rest
is logging, evaluation and the loop itself.

Phases are timed with the host clock only. On CUDA the kernels run asynchronously, so a
phase's time is the time the host spent issuing it plus whatever it waited for: the split
is approximate (the optimizer's host reads, e.g. the gradient norm, absorb kernels that the
forward-backward queued), while the sum over the interval is exact, since the trainer
synchronizes at the log interval's boundaries. ``train.timing_sync`` synchronizes the device
at the end of every phase for an exact split, at the cost of those synchronizations on
every step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["PHASES", "PhaseTimer", "breakdown_text"]

#: the phases of a step, as the logged keys name them (``<phase>_ms``)
PHASES = ("data", "fwd_bwd", "optim", "ckpt")


class PhaseTimer:
    """Sums the host time of each phase over a log interval.

    ``sync`` (``train.timing_sync``) synchronizes ``device`` at the end of each phase (on
    CUDA; nothing to wait for elsewhere).
    """

    def __init__(self, device: torch.device, *, sync: bool = False) -> None:
        self.device = device
        self.sync = sync and device.type == "cuda"
        self._totals = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the time of the ``with`` body to phase ``name`` (one of :data:`PHASES`)."""
        if name not in self._totals:
            raise ValueError(f"unknown phase {name!r}; the phases are {', '.join(PHASES)}")
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize(self.device)
            self._totals[name] += time.perf_counter() - start

    def take(self, steps: int) -> dict[str, float]:
        """``{"<phase>_ms": ms per step}`` over the last ``steps`` steps; starts a new interval."""
        per_step = 1e3 / max(steps, 1)
        out = {f"{name}_ms": total * per_step for name, total in self._totals.items()}
        self._totals = dict.fromkeys(PHASES, 0.0)
        return out


def breakdown_text(record: dict[str, float]) -> str:
    """The log line's part, ms per step: ``data 0.4 fb 12.1 opt 3.0 ckpt 8.2 ms`` (ckpt only
    when it shows, e.g. when the interval held a save)."""
    parts = [("data", "data_ms"), ("fb", "fwd_bwd_ms"), ("opt", "optim_ms")]
    if record.get("ckpt_ms", 0.0) >= 0.05:  # what prints as 0.0 is left out
        parts.append(("ckpt", "ckpt_ms"))
    return " ".join(f"{label} {record[key]:.1f}" for label, key in parts if key in record) + " ms"
