"""The offloaded update on a background thread, overlapping the next step's forward.

``DistributedOptimizer(optimizer_offload=True, overlap_host_update=True)``: ``step()`` copies
the gradients down, clips, then hands the per-shard host updates to one worker thread,
which runs them in the order the forward uses the shards (torch's fused CPU AdamW is itself
multithreaded) and sets one event per shard; ``step()`` returns at once. The worker does host
arithmetic only: every copy and every collective stays on the main thread, where the gate
(:class:`HostUpdate`, a :class:`~mega_zero_optim.param_gate.ParamGate`) uploads a shard and
launches its bucket's all-gather when the next forward first needs it:

- A bucket's all-gather asked for while the update runs (ZeRO-1/2: every bucket at the end of
  ``step()``; ZeRO-3: each gather unit's buckets and its prefetch) joins one queue. The queue
  is launched in order: at a forward pre-hook's wait it launches every request up to the one
  needed, blocking on their shards' updates; whenever the gate is entered it also launches
  the requests at its head whose shards are already updated, never blocking for them (this is
  ZeRO-3's prefetch, and ZeRO-1/2's gathers ahead of their layers). Every rank asks in the
  same order, so the collectives match whatever each rank's timing.
- A gradient collective of the same buckets first launches the whole queue (:meth:`flush`):
  gathers asked for before it are launched before it on every rank.
- At dp 1 there is no gather: a forward pre-hook on each module holding parameters uploads
  its shards (:func:`register_upload_hooks`).

:meth:`HostUpdate.wait` returns when everything is updated, uploaded and launched; the
optimizer calls it before anything reads or writes the masters, the optimizer state or the
host gradients (the next step, ``state_dict``, loading, ``reload_model_params``,
``memory_report``) and offers it as ``DistributedOptimizer.wait()``. An exception in the
worker stops it (the later shards are not updated) and is raised on the main thread by the
next wait that needs a shard it did not update, as one :class:`RuntimeError`, again at every
later wait.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mega_zero_optim.offload import HostShard, Offloader
from mega_zero_optim.param_gate import Gatherable

__all__ = ["HostUpdate", "ShardStep", "optimizer_view", "register_upload_hooks"]


@dataclass
class ShardStep:
    """One shard's host update: ``view`` (the optimizer over this shard's master pieces,
    hyperparameters as at ``step()``) steps its masters, then drops their gradients."""

    bucket: Gatherable
    host: HostShard
    view: torch.optim.Optimizer
    masters: list[torch.Tensor]

    def run(self) -> None:
        """Update the shard's masters in place (host arithmetic only: any thread)."""
        if self.view.param_groups:
            self.view.step()
        for m in self.masters:
            m.grad = None


#: the workers still updating; joined at exit (see :func:`_join_at_exit`)
_RUNNING: set[threading.Thread] = set()


def _join_at_exit() -> None:
    """Let a running update finish before the interpreter tears torch down: a daemon thread
    still inside torch's multithreaded CPU kernel at exit aborts the process ("terminate
    called without an active exception", seen on the GPU machine after a last ``step()``)."""
    for thread in list(_RUNNING):
        thread.join()


atexit.register(_join_at_exit)


class HostUpdate:
    """The worker thread of one step's host updates, and the gate of its shards' gathers."""

    def __init__(self, offloader: Offloader) -> None:
        self._offloader = offloader
        self._steps: list[ShardStep] = []
        self._position: dict[int, int] = {}  # id(bucket) -> its shard's place in _steps
        self._done: list[threading.Event] = []
        self._uploaded: list[bool] = []
        self._queue: list[Gatherable] = []
        self._queued: set[int] = set()
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None
        self._step_number = 0

    @property
    def active(self) -> bool:
        """True from :meth:`begin` until :meth:`wait` has returned."""
        return self._thread is not None

    def begin(
        self, steps: Sequence[ShardStep], requested: Sequence[Gatherable], number: int
    ) -> None:
        """Start the worker on ``steps`` (in order) and queue the gathers of ``requested``."""
        assert not self.active, "the optimizer waits for the last update first"
        self._steps = list(steps)
        self._position = {id(s.bucket): k for k, s in enumerate(self._steps)}
        self._done = [threading.Event() for _ in self._steps]
        self._uploaded = [False] * len(self._steps)
        self._queue = list(requested)
        self._queued = {id(b) for b in requested}
        self._error = None
        self._step_number = number
        # a daemon, joined at a normal exit (_join_at_exit); what must persist (a checkpoint)
        # waits for the update first
        self._thread = threading.Thread(target=self._work, name="mega-host-update", daemon=True)
        _RUNNING.add(self._thread)
        self._thread.start()

    def _work(self) -> None:
        for k, step in enumerate(self._steps):
            try:
                if self._error is None:
                    step.run()
            except BaseException as exc:  # raised on the main thread by its next wait
                self._error = (k, exc)
            finally:
                self._done[k].set()
        _RUNNING.discard(threading.current_thread())

    # shards ------------------------------------------------------------------------------

    def _raise_if_failed(self, k: int) -> None:
        if self._error is not None and k >= self._error[0]:
            failed, exc = self._error
            raise RuntimeError(
                f"the offloaded optimizer update of step {self._step_number} failed on its "
                f"shard {failed} ({type(exc).__name__}: {exc}); the shards from there on are "
                "not updated, so training cannot go on from this optimizer"
            ) from exc

    def _upload(self, k: int, *, block: bool) -> bool:
        """Upload shard ``k`` once updated; False (without blocking) when ``block`` is False
        and its update has not finished."""
        if self._uploaded[k]:
            return True
        if not block and not self._done[k].is_set():
            return False
        self._done[k].wait()
        self._raise_if_failed(k)
        self._offloader.params_up(self._steps[k].host)
        self._uploaded[k] = True
        return True

    def open(self, bucket: Gatherable) -> None:
        """Upload ``bucket``'s shard, waiting for its update (dp 1: no gather to launch)."""
        if self.active:
            self._upload(self._position[id(bucket)], block=True)
            for k in range(len(self._steps)):  # and those already updated, without waiting
                if not self._upload(k, block=False):
                    break

    # the gate ----------------------------------------------------------------------------

    def _launch_head(self) -> None:
        bucket = self._queue.pop(0)
        self._queued.discard(id(bucket))
        bucket.launch_param_sync()

    def _pump(self) -> None:
        """Launch the queue's head while its shard is already updated (never blocks)."""
        while self._queue and self._upload(self._position[id(self._queue[0])], block=False):
            self._launch_head()

    def defer(self, bucket: Gatherable) -> bool:
        """Queue ``bucket``'s gather while an update runs (see :class:`ParamGate`)."""
        if not self.active:
            return False
        if id(bucket) not in self._queued:
            self._queue.append(bucket)
            self._queued.add(id(bucket))
        self._pump()
        return True

    def force(self, bucket: Gatherable) -> None:
        """Launch the queue up to ``bucket``, waiting for their updates, then what is ready."""
        if id(bucket) not in self._queued:
            return
        while id(bucket) in self._queued:
            self._upload(self._position[id(self._queue[0])], block=True)
            self._launch_head()
        self._pump()

    def queued(self, bucket: Gatherable) -> bool:
        """True while ``bucket``'s gather waits in the queue."""
        return id(bucket) in self._queued

    def flush(self) -> None:
        """Launch the whole queue, waiting for the updates it needs."""
        if self._queue:
            self.force(self._queue[-1])

    def wait(self) -> None:
        """Return once every shard is updated and uploaded and every queued gather launched;
        the RuntimeError of a failed update otherwise."""
        if self._thread is None:
            return
        self._thread.join()
        self._raise_if_failed(len(self._steps))
        for k in range(len(self._steps)):
            self._upload(k, block=True)
        self.flush()
        self._thread = None
        self._steps, self._position = [], {}


def register_upload_hooks(
    module: nn.Module,
    buckets_of: Mapping[int, Sequence[Gatherable]],
    host_update: HostUpdate,
) -> list[Any]:
    """dp 1: a forward pre-hook on each submodule holding parameters directly uploads the
    shards of its buckets (``buckets_of[id(param)]``) before it runs; returns the handles."""
    handles = []
    for sub in module.modules():
        found: dict[int, Gatherable] = {}
        for p in sub.parameters(recurse=False):
            found.update({id(b): b for b in buckets_of.get(id(p), ())})
        if found:
            buckets = list(found.values())

            def hook(module: nn.Module, args: Any, buckets: list[Gatherable] = buckets) -> None:
                for bucket in buckets:
                    host_update.open(bucket)

            handles.append(sub.register_forward_pre_hook(hook))
    return handles


def optimizer_view(
    optimizer: torch.optim.Optimizer, masters: frozenset[int]
) -> torch.optim.Optimizer:
    """A view of ``optimizer`` stepping only the tensors whose ids are in ``masters``,
    sharing its state, with the hyperparameters as they are now (the update is elementwise,
    so stepping a shard's pieces apart is the same update); the optimizer's own param
    groups are never swapped under a reader (an LR schedule)."""
    subset = [
        {**g, "params": [m for m in g["params"] if id(m) in masters]}
        for g in optimizer.param_groups
    ]
    view = object.__new__(type(optimizer))
    # every attribute but an instance-level step (an LR scheduler's wrapper of it)
    view.__dict__.update({k: v for k, v in vars(optimizer).items() if k != "step"})
    view.param_groups = [g for g in subset if g["params"]]
    return view
