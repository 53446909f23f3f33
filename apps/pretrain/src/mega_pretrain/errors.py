"""The trainer's run-time stop, apart from the loop so that the command line can catch it
without importing torch."""

from __future__ import annotations

__all__ = ["TrainingError"]


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss or gradient under nan_policy='stop')."""
