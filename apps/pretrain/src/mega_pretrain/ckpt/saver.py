"""The trainer's saves, blocking or in the background, and the stall each one costs a step.

``CheckpointSaver`` is what the training loop calls: ``step_begins`` before each step
(it commits a finished background save and raises its error), ``save`` at a save step,
``finish`` at the end of the run (it waits for the background write), ``close`` on the way
out. Each save prints one line with its stall (the bench hook of ``checkpoint.async_save``:
the lead measures sync against async on the GPU from these lines).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from mega_parallel_grid import ProcessGroups
from mega_pretrain.build import Built
from mega_pretrain.ckpt.async_save import AsyncSaver
from mega_pretrain.ckpt.meta import CheckpointError
from mega_pretrain.ckpt.save import save_checkpoint
from mega_pretrain.config import CheckpointConfig

__all__ = ["CheckpointSaver", "StallClock"]


class StallClock:
    """Times the step that holds a save against the step before it.

    Only the steps around a save step (a multiple of ``interval``) are timed, each between
    two device synchronisations, so the other steps run as before. The stall of a save is
    the time of its step (forward-backward, optimizer, logging and the save's blocking
    part) minus the time of the step before.
    """

    def __init__(self, device: torch.device, interval: int) -> None:
        self.device, self.interval = device, interval
        self._start: tuple[int, float] | None = None  # (step, time it began)
        self._previous: tuple[int, float] | None = None  # (step, seconds it took)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def step_begins(self, step: int) -> None:
        """Step ``step`` (counted from 1) is about to run."""
        i = self.interval
        timed = i > 0 and (step % i == 0 or (step + 1) % i == 0)
        if not timed and self._start is None:
            return
        now = self._now()
        if self._start is not None and self._start[0] == step - 1:  # it held no save
            self._previous = (step - 1, now - self._start[1])
        self._start = (step, now) if timed else None

    def save_done(self, step: int) -> tuple[float, float | None] | None:
        """(seconds of step ``step`` with its save, seconds of the step before or None),
        or None when ``step`` was not timed."""
        if self._start is None or self._start[0] != step:
            return None
        with_save = self._now() - self._start[1]
        self._start = None
        before = self._previous
        return with_save, before[1] if before is not None and before[0] == step - 1 else None


class CheckpointSaver:
    """Saves the run's checkpoints as ``config`` says (``async_save``, ``keep_last``).

    Built on every rank at the same point (async: it creates process groups).
    """

    def __init__(
        self,
        run_dir: Path,
        built: Built,
        groups: ProcessGroups,
        config: CheckpointConfig,
        *,
        device: torch.device,
        timeout: timedelta,
        say: Callable[[str], None],
    ) -> None:
        self.run_dir, self.built, self.groups, self.config = run_dir, built, groups, config
        self._say = say
        self._async = (
            AsyncSaver(pin=device.type == "cuda", timeout=timeout) if config.async_save else None
        )
        self._clock = StallClock(device, config.save_interval)

    @property
    def mode(self) -> str:
        return "async" if self._async is not None else "sync"

    def step_begins(self, step: int) -> None:
        """Before step ``step`` (from 1): commit a finished background save (collective
        while one is in flight) and start timing the steps around a save."""
        if self._async is not None:
            done = self._async.poll()
            if done is not None:
                self._say_committed(*done)
        self._clock.step_begins(step)

    def save(self, step: int, trainer_state: dict[str, Any]) -> Path:
        """Save ``step``: the committed folder (sync), or the folder that the background
        write will commit (async). Prints the save's stall. Collective over all ranks."""
        began = time.perf_counter()
        self.finish()  # a second save waits for the first
        args = (self.run_dir, step, self.built, self.groups, trainer_state, self.config.keep_last)
        path = self._async.save(*args) if self._async is not None else save_checkpoint(*args)
        with_save, before = self._clock.save_done(step) or (None, None)
        line = f"checkpoint step {step} ({self.mode}): "
        if with_save is None:
            line += f"the save held training {time.perf_counter() - began:.3f} s"
        elif before is None:
            line += f"the step with the save took {with_save:.3f} s (no step without one before)"
        else:
            line += (
                f"step stall {with_save - before:.3f} s (the step with the save "
                f"{with_save:.3f} s, the step before {before:.3f} s)"
            )
        self._say(line + ("; writing in the background" if self._async is not None else ""))
        return path

    def finish(self) -> Path | None:
        """Wait for the background write (async); the folder it committed, or None."""
        if self._async is None:
            return None
        began = time.perf_counter()
        path = self._async.wait()
        if path is not None:
            self._say_committed(path, time.perf_counter() - began, waited=True)
        return path

    def close(self) -> None:
        """On the way out, after an error too: wait for the background write; a failure
        of it is said rather than raised over the error already on its way."""
        if self._async is None:
            return
        try:
            self._async.close()
        except CheckpointError as exc:
            self._say(str(exc))

    def _say_committed(self, path: Path, seconds: float, waited: bool = False) -> None:
        when = (
            f"the run waited {seconds:.3f} s for it"
            if waited
            else (f"{seconds:.3f} s after its save began; written in the background")
        )
        self._say(f"checkpoint {path.name} committed ({when})")
