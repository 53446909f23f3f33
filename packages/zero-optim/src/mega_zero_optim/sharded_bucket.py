"""One bucket of the sharded stages: gradients (ZeRO-2) and parameters (ZeRO-3) freed whole.

The bucket owns its full-size tensors; "freeing" one resizes its storage to zero bytes and
"allocating" it resizes it back, so every view into it (a parameter's ``.data``, its
``main_grad``, a tensor autograd saved in forward) stays the same tensor object and sees
the new memory. What persists between uses is this rank's shard only: ``grad_shard`` (the
reduced gradients, accumulated over microbatches) and, for ZeRO-3, ``param_shard``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from mega_zero_optim.bucket import BucketState
from mega_zero_optim.hsdp import reduce_grads
from mega_zero_optim.param_gate import ParamGate
from mega_zero_optim.shard_range import Range, shard_of

__all__ = ["ShardedBucket", "free_storage", "storage_bytes"]


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes currently allocated by ``t``'s storage (0 once freed)."""
    return int(t.untyped_storage().nbytes())


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory; the tensor object and its views survive, holding no data."""
    t.untyped_storage().resize_(0)


def _allocate(t: torch.Tensor) -> bool:
    """Give a freed ``t`` its memory back (uninitialised); False when it was allocated."""
    want = t.numel() * t.element_size()
    if storage_bytes(t) == want:
        return False
    t.untyped_storage().resize_(want)
    return True


class ShardedBucket:
    """Gradients of ``where`` reduce-scattered into this rank's shard; parameters gathered on use.

    Gradients accumulate into :attr:`grad_data`, allocated when the first one arrives; its
    reduce-scatter writes (or adds) this rank's part into :attr:`grad_shard`, after which
    the full gradients are freed and the next microbatch's gradients open the bucket anew.
    With ``shard_params`` the parameters live in :attr:`param_shard`; :meth:`start_param_sync`
    / :meth:`finish_param_sync` all-gather them into :attr:`param_data` and point each
    member's ``.data`` at its view, :meth:`free_params` drops them again (the members then
    hold a NaN expanded to their shape). Without it, :attr:`param_data` is a view of a whole buffer that
    stays allocated, as in ZeRO-1.
    """

    def __init__(
        self,
        index: int,
        where: Range,
        members: list[tuple[nn.Parameter, Range]],
        *,
        grad_shard: torch.Tensor,
        param_shard: torch.Tensor,
        param_data: torch.Tensor,
        grad_dtype: torch.dtype,
        dp_group: ProcessGroup,
        average: bool,
        shard_params: bool,
        replicate_group: ProcessGroup | None = None,
    ) -> None:
        self.index = index
        self.where = where
        self.param_ids = [id(p) for p, _ in members]
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
        self.shard = shard_of(where, self.dp_size, self.dp_rank)
        self.replicate_group = replicate_group
        replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        self._communicates = self.dp_size * replicas > 1
        self.scale = 1.0 / (self.dp_size * replicas) if average else 1.0
        self.shard_params = shard_params
        self.param_data = param_data  # [bucket]
        self.param_shard = param_shard  # [bucket/dp]
        self.grad_shard = grad_shard  # [bucket/dp], persistent
        device = param_data.device
        # [bucket], allocated until the owner has made its views and calls reset()
        self.grad_data = torch.empty(where.size, dtype=grad_dtype, device=device)
        self._members = [
            (p, param_data[r.start - where.start : r.end - where.start].view(p.shape))
            for p, r in members
        ]
        # between uses a member holds a NaN broadcast to its shape: its shape and dim stay
        # true (optimizer groups, autograd's gradient layout), reading it gives NaN, not
        # freed memory, and writing it fails (one element shared by all)
        nan = torch.full((1,), float("nan"), dtype=param_data.dtype, device=device)
        self._placeholders = [nan.expand(p.shape) for p, _ in members]
        self.state = BucketState.ACCUMULATING
        self._waiting: set[int] = set(self.param_ids)
        self._touched = False  # a gradient arrived since the last reduce-scatter
        self._shard_holds = False  # grad_shard holds reduced gradients since zero_grad
        self._grad_out: torch.Tensor | None = None
        self._grad_work: dist.Work | None = None
        self._param_work: dist.Work | None = None
        #: set while an optimizer's update may still run (see :mod:`mega_zero_optim.param_gate`)
        self.param_gate: ParamGate | None = None
        self._backward_waiting: set[int] = set(self.param_ids)

    # gradients ---------------------------------------------------------------------------

    def open_grads(self) -> None:
        """Make :attr:`grad_data` ready to accumulate into (a new microbatch reopens it)."""
        if self.state is not BucketState.ACCUMULATING:
            self.finish_grad_sync()
            self.state = BucketState.ACCUMULATING
            self._waiting = set(self.param_ids)
        if _allocate(self.grad_data):
            self.grad_data.zero_()
        self._touched = True

    def mark_ready(self, param_id: int) -> bool:
        """Record that a parameter's gradient is complete; True when it was the last one."""
        self._waiting.discard(param_id)
        return not self._waiting

    def start_grad_sync(self) -> None:
        """Launch the reduce-scatter of the accumulated gradients, if any (asynchronously)."""
        if self.state is not BucketState.ACCUMULATING or not self._touched:
            return
        self.state = BucketState.REDUCING
        if not self._communicates:
            return
        if self.param_gate is not None:  # gathers asked for before go first on every rank
            self.param_gate.flush()
        if self.scale != 1.0:
            self.grad_data.mul_(self.scale)
        # [bucket] -> [bucket/dp]: straight into the shard on the step's first reduction
        out = torch.empty_like(self.grad_shard) if self._shard_holds else self.grad_shard
        self._grad_out = out
        self._grad_work = reduce_grads(out, self.grad_data, self.dp_group, self.replicate_group)

    @property
    def grad_sync_done(self) -> bool:
        """True when a launched reduce-scatter has completed (its wait would not block)."""
        work = self._grad_work
        return self.state is BucketState.REDUCING and (work is None or work.is_completed())

    def finish_grad_sync(self) -> None:
        """Launch the reduction if needed, wait, add it into the shard, free the gradients."""
        self.start_grad_sync()
        if self.state is not BucketState.REDUCING:
            return
        if self._grad_work is not None:
            self._grad_work.wait()
            self._grad_work = None
        if not self._communicates:  # the shard is the whole bucket
            if self._shard_holds:
                self.grad_shard.add_(self.grad_data, alpha=self.scale)
            else:
                self.grad_shard.copy_(self.grad_data)
                if self.scale != 1.0:
                    self.grad_shard.mul_(self.scale)
        elif self._grad_out is not None and self._grad_out is not self.grad_shard:
            self.grad_shard.add_(self._grad_out)
        self._grad_out = None
        self._shard_holds = True
        self._touched = False
        free_storage(self.grad_data)
        self.state = BucketState.REDUCED

    def reset(self) -> None:
        """Start a new step (the buffer zeroes the shards): no gradients, none awaited."""
        if self._grad_work is not None:
            self._grad_work.wait()
            self._grad_work = None
        self._grad_out = None
        free_storage(self.grad_data)
        self._touched = self._shard_holds = False
        self.state = BucketState.ACCUMULATING
        self._waiting = set(self.param_ids)

    # parameters --------------------------------------------------------------------------

    @property
    def gathered(self) -> bool:
        """True while the full parameters are allocated (gathered or being gathered)."""
        return storage_bytes(self.param_data) > 0

    @property
    def param_sync_pending(self) -> bool:
        """True while a parameter all-gather is in flight (or queued by a gate)."""
        gate = self.param_gate
        return self._param_work is not None or (gate is not None and gate.queued(self))

    def start_param_sync(self) -> bool:
        """Launch the all-gather of the parameters (asynchronously); False when not needed."""
        if self.dp_size == 1 or self._param_work is not None:
            return False
        if self.shard_params and not _allocate(self.param_data):
            return False  # gathered already (or queued by a gate)
        if self.param_gate is None or not self.param_gate.defer(self):
            self.launch_param_sync()
        return True

    def launch_param_sync(self) -> None:
        """The all-gather itself, asking no gate."""
        # [bucket/dp] -> [bucket], each rank's shard copied to every rank
        self._param_work = dist.all_gather_into_tensor(
            self.param_data, self.param_shard, group=self.dp_group, async_op=True
        )

    def finish_param_sync(self) -> None:
        """Wait for the parameter all-gather, if in flight; members then view the full values."""
        if self.param_gate is not None:  # launch it first if a gate queued it
            self.param_gate.force(self)
        if self._param_work is not None:
            self._param_work.wait()
            self._param_work = None
        if self.shard_params:
            for p, view in self._members:
                if p.data.data_ptr() != view.data_ptr() or p.data.shape != view.shape:
                    p.data = view

    def free_params(self) -> bool:
        """Drop the full parameters (ZeRO-3, dp > 1); False when there was nothing to free."""
        if not self.shard_params or self.dp_size == 1 or not self.gathered:
            return False
        if self.param_gate is not None:  # a queued gather is launched in order, then dropped
            self.param_gate.force(self)
        if self._param_work is not None:
            self._param_work.wait()
            self._param_work = None
        for (p, _), placeholder in zip(self._members, self._placeholders, strict=True):
            p.data = placeholder
        free_storage(self.param_data)
        return True

    def expect_backward(self) -> None:
        """Await every member's gradient in the coming backward (see :meth:`backward_ready`)."""
        self._backward_waiting = set(self.param_ids)

    def backward_ready(self, param_id: int) -> bool:
        """Record a member's gradient of this backward; True once all of them arrived."""
        self._backward_waiting.discard(param_id)
        return not self._backward_waiting
