"""One bucket: a slice of a buffer whose gradients are reduced, and parameters gathered, at once."""

from __future__ import annotations

from enum import Enum

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mega_zero_optim.hsdp import all_reduce_grads, reduce_grads
from mega_zero_optim.param_gate import ParamGate
from mega_zero_optim.shard_range import Range, shard_of

__all__ = ["Bucket", "BucketState"]


class BucketState(Enum):
    """Where a bucket's gradients stand in the current step."""

    ACCUMULATING = "accumulating"
    """Backward passes add into it; no collective issued yet."""
    REDUCING = "reducing"
    """Its collective is in flight."""
    REDUCED = "reduced"
    """Its collective finished: the owned shard (or all of it, after all-reduce) is reduced."""


class Bucket:
    """The gradients and parameters in ``where`` of one buffer, and their asynchronous collectives.

    Gradients: a reduce-scatter leaves each dp rank the reduced values of its own shard
    (:attr:`shard`); an all-reduce leaves every rank all of them. Parameters: an all-gather
    copies each rank's shard to every rank. Both run in place on the buffers. With a dp
    group of one rank no collective is issued.
    """

    def __init__(
        self,
        index: int,
        where: Range,
        param_ids: list[int],
        param_data: torch.Tensor,
        grad_data: torch.Tensor,
        *,
        dp_group: ProcessGroup,
        reduce_scatter: bool,
        average: bool,
        replicate_group: ProcessGroup | None = None,
    ) -> None:
        self.index = index
        self.where = where
        self.param_ids = param_ids
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
        self.shard = shard_of(where, self.dp_size, self.dp_rank)
        self.reduce_scatter = reduce_scatter
        self.replicate_group = replicate_group
        replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        self._communicates = self.dp_size * replicas > 1
        self.scale = 1.0 / (self.dp_size * replicas) if average else 1.0
        # views into the buffers: [bucket] and [bucket/dp]
        self.param_data = param_data[where.start : where.end]
        self.grad_data = grad_data[where.start : where.end]
        self.param_shard = param_data[self.shard.start : self.shard.end]
        self.grad_shard = grad_data[self.shard.start : self.shard.end]
        self.state = BucketState.ACCUMULATING
        self._waiting: set[int] = set(param_ids)
        self._grad_work: dist.Work | None = None
        self._param_work: dist.Work | None = None
        #: set while an optimizer's update may still run (see :mod:`mega_zero_optim.param_gate`)
        self.param_gate: ParamGate | None = None

    def mark_ready(self, param_id: int) -> bool:
        """Record that a parameter's gradient is complete; True when it was the last one."""
        assert self.state is BucketState.ACCUMULATING, "the DDP hook checks this first"
        self._waiting.discard(param_id)
        return not self._waiting

    def start_grad_sync(self) -> None:
        """Launch the gradient collective (asynchronously); a no-op when already launched."""
        if self.state is not BucketState.ACCUMULATING:
            return
        self.state = BucketState.REDUCING
        if not self._communicates:
            return
        if self.param_gate is not None:  # gathers asked for before go first on every rank
            self.param_gate.flush()
        if self.scale != 1.0:
            self.grad_data.mul_(self.scale)
        if self.reduce_scatter:
            # [bucket] -> [bucket/dp], written in place into this rank's shard
            self._grad_work = reduce_grads(
                self.grad_shard, self.grad_data, self.dp_group, self.replicate_group
            )
        else:
            self._grad_work = all_reduce_grads(self.grad_data, self.dp_group, self.replicate_group)

    def finish_grad_sync(self) -> None:
        """Launch the collective if needed and wait for it."""
        self.start_grad_sync()
        if self._grad_work is not None:
            self._grad_work.wait()
            self._grad_work = None
        self.state = BucketState.REDUCED

    def reset(self) -> None:
        """Start a new step: every parameter's gradient is awaited again."""
        if self._grad_work is not None:  # never leave a collective writing into the buffer
            self._grad_work.wait()
            self._grad_work = None
        self.state = BucketState.ACCUMULATING
        self._waiting = set(self.param_ids)

    def start_param_sync(self) -> None:
        """Launch the all-gather of parameters from each rank's shard (asynchronously)."""
        if self.dp_size == 1 or self._param_work is not None:
            return
        if self.param_gate is not None and self.param_gate.defer(self):
            return
        self.launch_param_sync()

    def launch_param_sync(self) -> None:
        """The all-gather itself, asking no gate."""
        # [bucket/dp] -> [bucket], each rank's shard copied in place to every rank
        self._param_work = dist.all_gather_into_tensor(
            self.param_data, self.param_shard, group=self.dp_group, async_op=True
        )

    def finish_param_sync(self) -> None:
        """Wait for the parameter all-gather, if one is in flight (or queued by a gate)."""
        if self.param_gate is not None:
            self.param_gate.force(self)
        if self._param_work is not None:
            self._param_work.wait()
            self._param_work = None

    @property
    def param_sync_pending(self) -> bool:
        """True while a parameter all-gather is in flight (or queued by a gate)."""
        gate = self.param_gate
        return self._param_work is not None or (gate is not None and gate.queued(self))
