"""SIGTERM/SIGINT (cluster preemption): ask the loop to save and stop at the next step.

A run that ended cleanly says so in ``<run folder>/run_end``, written after its last
checkpoint is committed, so that a launcher need not trust torchrun's exit code (torchrun
exits 1 when it was signalled, however its workers ended): ``examples/slurm_exit_status.sh``
reads it.
"""

from __future__ import annotations

import os
import signal
import types
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["RUN_END_FILE", "StopRequest", "write_run_end"]

#: the file in the run folder that a clean end writes: ``key=value`` lines
RUN_END_FILE = "run_end"


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


def write_run_end(
    run_dir: Path, *, stopped_by: str | None, step: int, steps: int, checkpoint: Path | None
) -> Path:
    """Record a clean end in ``run_dir/run_end`` (call once the last checkpoint is committed).

    ``key=value`` lines, so that a shell reads them without running anything:
    ``state`` (``done`` or ``stopped``), ``by`` (the signal's name or ``exit_interval``;
    empty when done), ``step``, ``steps`` (the run's train.steps) and ``checkpoint`` (the
    folder name under ``checkpoints/``, as ``latest`` names it). Written atomically.
    """
    state = "stopped" if stopped_by is not None and step < steps else "done"
    lines = [
        f"state={state}",
        f"by={stopped_by or ''}",
        f"step={step}",
        f"steps={steps}",
        f"checkpoint={checkpoint.name if checkpoint is not None else ''}",
    ]
    path = Path(run_dir) / RUN_END_FILE
    tmp = path.with_name(f".{RUN_END_FILE}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path
