"""The buffers of the sharded stages: per-bucket full tensors, persistent per-rank shards."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from mega_zero_optim.hsdp import broadcast_from_first
from mega_zero_optim.shard_range import Range, aligned_layout, shard_of
from mega_zero_optim.sharded_bucket import ShardedBucket, storage_bytes

__all__ = ["ShardedBuffer"]


class ShardedBuffer:
    """The parameters of one dtype, for ``sharding="gradients"`` or ``"parameters"``.

    Laid out like :class:`~mega_zero_optim.buffer.ParamAndGradBuffer` (packing order, dp
    shards of every bucket), except that buckets end at parameter boundaries and never mix
    two gather units (``units[i]`` is parameter ``i``'s), since each bucket's full
    gradients, and with ``shard_params`` its full parameters, are a storage of its own that
    is freed and re-allocated whole. What stays allocated on every rank: the
    gradient shards (:attr:`grad_shard_data`, ``numel/dp`` elements), and either the whole
    parameter buffer (:attr:`param_data`, ZeRO-2) or the parameter shards
    (:attr:`param_shard_data`, ZeRO-3).
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        units: Sequence[int],
        *,
        grad_dtype: torch.dtype,
        bucket_size: int | None,
        dp_group: ProcessGroup,
        average: bool,
        shard_params: bool,
        replicate_group: ProcessGroup | None = None,
    ) -> None:
        assert named_params, "a buffer needs at least one parameter"
        first = named_params[0][1]
        self.param_dtype = first.dtype
        self.grad_dtype = grad_dtype
        self.device = first.device
        self.shard_params = shard_params
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        dp, rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.ranges, cuts = aligned_layout([p.numel() for p in self.params], units, bucket_size, dp)
        total = cuts[-1].end
        dev = self.device
        self.grad_shard_data = torch.zeros(total // dp, dtype=grad_dtype, device=dev)
        self.param_shard_data: torch.Tensor | None = None
        self.param_data: torch.Tensor | None = None
        if shard_params:
            self.param_shard_data = torch.empty(total // dp, dtype=self.param_dtype, device=dev)
        else:
            self.param_data = torch.zeros(total, dtype=self.param_dtype, device=dev)
        ids = [id(p) for p in self.params]
        self.buckets: list[ShardedBucket] = []
        #: id(param) -> indices of the buckets it lies in (always one here)
        self.buckets_of: dict[int, list[int]] = {i: [] for i in ids}
        self.main_grads: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
        for b, where in enumerate(cuts):
            inside = [i for i, r in enumerate(self.ranges) if r.intersect(where)]
            shard = Range(where.start // dp, where.end // dp)  # in the shard buffers
            owned = shard_of(where, dp, rank)
            param_full, param_shard = self._param_tensors(where, shard, owned)
            for i in inside:
                r = self.ranges[i].shift(where.start)
                param_full[r.start : r.end].view(self.params[i].shape).copy_(self.params[i].data)
                self.buckets_of[ids[i]].append(b)
            bucket = ShardedBucket(
                b,
                where,
                [(self.params[i], self.ranges[i]) for i in inside],
                grad_shard=self.grad_shard_data[shard.start : shard.end],
                param_shard=param_shard,
                param_data=param_full,
                grad_dtype=grad_dtype,
                dp_group=dp_group,
                average=average,
                shard_params=shard_params,
                replicate_group=replicate_group,
            )
            bucket.finish_param_sync()  # ZeRO-3: members view the bucket's full tensor
            for i in inside:
                r = self.ranges[i].shift(where.start)
                main_grad = bucket.grad_data[r.start : r.end].view(self.params[i].shape)
                self.params[i].main_grad = main_grad  # type: ignore[attr-defined]
                self.main_grads[i] = main_grad
            bucket.reset()  # frees the full gradients until the first one arrives
            self.buckets.append(bucket)
        if not shard_params:
            assert self.param_data is not None
            for p, r in zip(self.params, self.ranges, strict=True):
                view = self.param_data[r.start : r.end].view(p.shape)
                p.data = view

    def _param_tensors(self, where: Range, shard: Range, owned: Range) -> tuple[torch.Tensor, ...]:
        """A bucket's full parameter tensor ``[bucket]`` and this rank's shard ``[bucket/dp]``
        (``shard``: where it lies in the shard buffers, ``owned``: in the full layout)."""
        if self.param_data is not None:  # ZeRO-2: views of the whole buffer
            full = self.param_data[where.start : where.end]
            return full, self.param_data[owned.start : owned.end]
        assert self.param_shard_data is not None
        shard_view = self.param_shard_data[shard.start : shard.end]
        if shard.size == where.size:  # dp 1: the shard is the whole bucket
            return shard_view, shard_view
        full = torch.empty(where.size, dtype=self.param_dtype, device=self.device)
        return full, shard_view

    def shard_and_free(
        self,
        dp_group: ProcessGroup,
        *,
        broadcast: bool,
        replicate_group: ProcessGroup | None = None,
    ) -> None:
        """Make replicas equal (dp rank 0's values), then keep only this rank's shard.

        ZeRO-2 broadcasts the whole parameter buffer. ZeRO-3 broadcasts each bucket,
        copies this rank's part into its shard and frees the full parameters.
        """
        dp = dist.get_world_size(dp_group)
        if self.param_data is not None:
            if broadcast:
                broadcast_from_first(self.param_data, dp_group, replicate_group)
            return
        for bucket in self.buckets:
            if broadcast:
                broadcast_from_first(bucket.param_data, dp_group, replicate_group)
            if dp == 1:
                continue
            local = bucket.shard.shift(bucket.where.start)
            bucket.param_shard.copy_(bucket.param_data[local.start : local.end])
            bucket.free_params()

    @property
    def numel(self) -> int:
        """Elements of the full layout, padding included."""
        return self.buckets[-1].where.end

    @property
    def num_params(self) -> int:
        """Parameter elements in the buffer, padding excluded."""
        return sum(r.size for r in self.ranges)

    @property
    def param_bytes(self) -> int:
        """Parameter bytes allocated now: the whole buffer (ZeRO-2), or the shards plus the
        full buckets currently gathered (ZeRO-3)."""
        if self.param_data is not None:
            return storage_bytes(self.param_data)
        assert self.param_shard_data is not None
        gathered = sum(
            storage_bytes(b.param_data)
            for b in self.buckets
            if b.param_data.untyped_storage().data_ptr()
            != self.param_shard_data.untyped_storage().data_ptr()
        )
        return storage_bytes(self.param_shard_data) + gathered

    @property
    def grad_bytes(self) -> int:
        """Gradient bytes allocated now: the shards plus the buckets still accumulating."""
        alive = sum(storage_bytes(b.grad_data) for b in self.buckets)
        return storage_bytes(self.grad_shard_data) + alive

    def zero_grad(self) -> None:
        """Zero the gradient shards, free every bucket's full gradients, await them again."""
        for bucket in self.buckets:
            bucket.reset()
        self.grad_shard_data.zero_()
