"""HSDP's collectives: reduce within the shard group, then across the replicas of each shard.

With ``replicate_group`` the dp ranks form a grid ``dp_shard x dp_replicate``: each bucket is
sharded over the shard group (``dp_group``) and every shard is held by each rank of its
replicate group. A gradient bucket is reduce-scattered within the shard group first and the
``1/dp_shard``-sized result all-reduced across the replicate group second. The reverse order
(all-reduce the full bucket across replicas, then reduce-scatter) gives the same sums but
sends ``dp_shard`` times more bytes over the replicate group, which spans nodes when the
shard group is a node (the layout's default): the order here is the one whose slow-link
traffic is smallest, as in Megatron's partial distributed optimizer and FSDP2's HSDP.
Parameters are all-gathered within the shard group only; replicas compute the same update.

The all-reduce is launched right behind the reduce-scatter, after waiting for it: on NCCL
that wait only orders the streams (the host goes on with backward), on gloo it blocks the
host until the reduce-scatter is done. Launching it later, when the reduce-scatter is found
complete, would let ranks launch their buckets' all-reduces in different orders, which the
collectives of one group must not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["all_reduce_grads", "broadcast_from_first", "reduce_grads"]


def reduce_grads(
    out: torch.Tensor,
    grads: torch.Tensor,
    shard_group: ProcessGroup,
    replicate_group: ProcessGroup | None,
) -> dist.Work:
    """Sum ``grads`` ``[bucket]`` over every dp rank into this rank's shard ``out``
    ``[bucket/dp_shard]``, asynchronously: reduce-scatter within ``shard_group``, then
    all-reduce across ``replicate_group`` (when given)."""
    if dist.get_world_size(shard_group) == 1:  # the shard is the whole bucket
        if out.data_ptr() != grads.data_ptr():
            out.copy_(grads)
        assert replicate_group is not None, "nothing to reduce: the caller checks"
        return dist.all_reduce(out, group=replicate_group, async_op=True)
    first = dist.reduce_scatter_tensor(out, grads, group=shard_group, async_op=True)
    assert first is not None, "async_op returns a work"
    return _then_across(first, out, replicate_group)


def all_reduce_grads(
    grads: torch.Tensor, shard_group: ProcessGroup, replicate_group: ProcessGroup | None
) -> dist.Work:
    """Sum ``grads`` over every dp rank in place (plain DDP): within the shard group, then
    across the replicas."""
    first = dist.all_reduce(grads, group=shard_group, async_op=True)
    return _then_across(first, grads, replicate_group)


def _then_across(
    first: dist.Work, tensor: torch.Tensor, replicate_group: ProcessGroup | None
) -> dist.Work:
    """``first``, followed by the all-reduce of ``tensor`` across the replicas (if any)."""
    if replicate_group is None or dist.get_world_size(replicate_group) == 1:
        return first
    first.wait()  # see the module doc: the same launch order on every rank
    work = dist.all_reduce(tensor, group=replicate_group, async_op=True)
    assert work is not None, "async_op returns a work"
    return work


def broadcast_from_first(
    tensor: torch.Tensor, shard_group: ProcessGroup, replicate_group: ProcessGroup | None
) -> None:
    """Give every dp rank the values of the first rank of the first replica."""
    if replicate_group is not None and dist.get_world_size(replicate_group) > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(replicate_group, 0), group=replicate_group)
    if dist.get_world_size(shard_group) > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(shard_group, 0), group=shard_group)
