"""SIGTERM/SIGINT (cluster preemption): ask the loop to save and stop at the next step."""

from __future__ import annotations

import signal
import types

import torch
import torch.distributed as dist

__all__ = ["StopRequest"]


class StopRequest:
    """Installs handlers for SIGTERM and SIGINT; ``requested()`` agrees across ranks.

    The agreement runs on a gloo group of all ranks (CPU only: it never waits on the GPU),
    so every rank stops after the same step even if the signal reached them at
    different times.
    """

    def __init__(self) -> None:
        self._flag = False
        self._previous = {
            sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        self._group: dist.ProcessGroup | None = None
        if dist.get_world_size() > 1:
            group = dist.new_group(backend="gloo")
            assert isinstance(group, dist.ProcessGroup)
            self._group = group
        self.signal_name: str | None = None

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        self._flag = True
        self.signal_name = signal.Signals(signum).name

    def requested(self) -> bool:
        """True on every rank once any rank received a signal (collective when world > 1)."""
        if self._group is None:
            return self._flag
        flag = torch.tensor([1 if self._flag else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
