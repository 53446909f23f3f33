"""The protocol between a bucket's parameter all-gather and an update still running elsewhere.

A bucket with a ``param_gate`` (set by :class:`~mega_zero_optim.DistributedOptimizer` with
``overlap_host_update``) hands every all-gather request to the gate instead of launching it:
the gate launches the gathers in the order they were asked for, each once this rank's shard
has been updated and uploaded, so the sequence of collectives is the same on every rank
whatever the timing of each rank's update.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Gatherable", "ParamGate"]


class Gatherable(Protocol):
    """A bucket whose parameter all-gather the gate launches."""

    def launch_param_sync(self) -> None:
        """Launch the all-gather now (asynchronously), asking no gate."""


class ParamGate(Protocol):
    """Holds a bucket's all-gather until its shard holds the step's new values."""

    def defer(self, bucket: Gatherable) -> bool:
        """Take the request (True: the gate launches it, now or later; False: no update runs,
        the caller launches it)."""

    def force(self, bucket: Gatherable) -> None:
        """Launch a taken request now, and every request taken before it (may block)."""

    def queued(self, bucket: Gatherable) -> bool:
        """True while a taken request has not been launched."""

    def flush(self) -> None:
        """Launch every taken request (before a collective that must follow them)."""
