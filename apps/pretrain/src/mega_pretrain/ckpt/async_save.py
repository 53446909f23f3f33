"""Checkpoints written in the background while training goes on (``checkpoint.async_save``).

A save copies this rank's tensors into host memory (pinned on a GPU, so the copy runs at
full PCIe speed; the buffers are kept for the next save), then hands them to
``torch.distributed.checkpoint.async_save``, which writes them from a thread. A second
thread of ours waits for that write and then finishes the save exactly as the blocking
path does (:func:`mega_pretrain.ckpt.save.finish_save`): RNG files, CRC-32 digests in
meta.json, and the commit, which renames the folder and moves ``latest`` only once every
rank's write finished, then prunes. So a kill at any moment before the commit leaves the
previous checkpoint and ``latest`` as they were.

The background collectives run on gloo groups of their own, never on the training
groups. ``poll`` (each step) agrees across ranks on whether every rank's save is done, so
an error of the background write is raised on every rank at the same step; ``save``
waits for the save still in flight before it starts, and the trainer waits at its end.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save

from mega_parallel_grid import ProcessGroups
from mega_pretrain.build import Built
from mega_pretrain.ckpt.integrity import write_failure
from mega_pretrain.ckpt.meta import CheckpointError
from mega_pretrain.ckpt.save import PendingSave, finish_save, prepare_save

__all__ = ["AsyncSaver", "HostStager"]

#: How often a wait for the background write wakes the main thread. A signal that the
#: kernel delivers to another thread (the writer's) does not interrupt the main thread's
#: blocked lock wait, so Python would run a SIGTERM handler only once the write ended;
#: waking every 0.1 s runs it at once.
_WAKE_S = 0.1


class HostStager:
    """Copies tensors into host buffers that it keeps from one save to the next."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._buffers: dict[str, Tensor] = {}

    def stage(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Host copies of ``tensors`` (the same keys), complete when this returns."""
        out: dict[str, Tensor] = {}
        for key, tensor in tensors.items():
            buffer = self._buffers.get(key)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin)
            buffer.copy_(tensor.detach(), non_blocking=self.pin)
            out[key] = buffer
        self._buffers = out
        if self.pin:
            torch.cuda.synchronize()  # the copies above are asynchronous into pinned memory
        return out


class _StagedWriter(FileSystemWriter):
    """A FileSystemWriter for tensors already staged on the host: DCP's own staging, a
    second copy, is skipped."""

    def stage(self, state_dict: Any) -> Any:
        self.per_thread_copy_ahead = 0
        return state_dict


@dataclass
class _InFlight:
    step: int
    final: Path
    job: Future[Path]
    started: float


class AsyncSaver:
    """Saves like ``save_checkpoint``, returning as soon as the tensors are on the host.

    Built on every rank at the same point (it creates two gloo groups: collective).
    """

    def __init__(self, *, pin: bool, timeout: timedelta) -> None:
        self._write_group = _gloo_group(timeout)  # DCP's and the commit's collectives
        self._poll_group = _gloo_group(timeout)  # the per-step agreement of poll()
        self._stager = HostStager(pin)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mega-ckpt")
        self._in_flight: _InFlight | None = None

    @property
    def in_flight(self) -> int | None:
        """The step of the save being written, or None."""
        return None if self._in_flight is None else self._in_flight.step

    @torch.no_grad()
    def save(
        self,
        run_dir: Path,
        step: int,
        built: Built,
        groups: ProcessGroups,
        trainer_state: dict[str, Any],
        keep_last: int = 2,
    ) -> Path:
        """Start saving ``step``; returns the folder it will be committed as. Waits for the
        save before it first (raising its error). Collective over all ranks."""
        self.wait()
        pending = prepare_save(run_dir, step, built, groups, trainer_state, keep_last)
        pending.tensors = self._stager.stage(pending.tensors)
        started: Any = dcp_async_save(
            pending.tensors, storage_writer=_StagedWriter(pending.tmp),
            process_group=self._write_group,
        )  # fmt: skip
        # a Future; torch >= 2.8 answers a stager that stages asynchronously (not ours)
        # with an AsyncSaveResponse holding it
        future: Future[Any] = getattr(started, "upload_completion", started)
        job = self._executor.submit(self._finish, pending, future)
        self._in_flight = _InFlight(step, pending.final, job, time.perf_counter())
        return pending.final

    def _finish(self, pending: PendingSave, write: Future[Any]) -> Path:
        try:
            write.result()
        except CheckpointException as exc:
            raise write_failure(pending.tmp, exc, pending.rank_bytes) from None
        return finish_save(pending, self._write_group)

    def poll(self) -> tuple[Path, float] | None:
        """When every rank's save in flight is committed: its folder and how long it took
        (its error raised, on every rank alike); None while any rank is still writing.
        Collective over all ranks while a save is in flight."""
        if self._in_flight is None:
            return None
        done = torch.tensor([1 if self._in_flight.job.done() else 0], dtype=torch.int32)
        if dist.get_world_size(self._poll_group) > 1:
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._poll_group)
        if not done.item():
            return None
        seconds = time.perf_counter() - self._in_flight.started
        path = self.wait()
        assert path is not None
        return path, seconds

    def wait(self) -> Path | None:
        """Wait for the save in flight; its committed folder, or None when none was."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return None
        try:
            while not wait_for([in_flight.job], timeout=_WAKE_S).done:
                pass  # the interpreter runs pending signal handlers between the waits
            return in_flight.job.result()
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint.async_save: {exc}") from None
        except (RuntimeError, OSError) as exc:  # a collective of the background write
            raise CheckpointError(
                f"checkpoint.async_save: the background write of {in_flight.final} failed "
                f"({type(exc).__name__}: {' '.join(str(exc).split())}); the folder was not "
                "committed, latest still names the checkpoint before it"
            ) from None

    def close(self) -> None:
        """Wait for the save in flight (see ``wait``) and stop the background thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)


def _gloo_group(timeout: timedelta) -> dist.ProcessGroup:
    group = dist.new_group(backend="gloo", timeout=timeout)
    assert isinstance(group, dist.ProcessGroup)
    return group
