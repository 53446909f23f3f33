"""The fp32 master shards one dp rank owns, and the pieces of parameters the optimizer steps.

:class:`~mega_zero_optim.optimizer.DistributedOptimizer` keeps one :class:`MasterShard` per
bucket of every wrapped module's buffers (the bucket's owned shard, in fp32: a new device
tensor for bf16/fp16 parameters, the parameter shard itself for fp32 ones, a host tensor with
``optimizer_offload``) and cuts it into one :class:`MasterPiece` per parameter with elements
in it: the views its wrapped optimizer steps and whose state it saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mega_zero_optim.bucket import Bucket
from mega_zero_optim.buffer import ParamAndGradBuffer
from mega_zero_optim.clip import counts_in_norm
from mega_zero_optim.ddp import DistributedDataParallel
from mega_zero_optim.flat_adamw import FlatShard
from mega_zero_optim.offload import HostShard, Offloader
from mega_zero_optim.shard_range import Range, owned_pieces
from mega_zero_optim.sharded_bucket import ShardedBucket
from mega_zero_optim.sharded_buffer import ShardedBuffer

__all__ = [
    "MasterPiece",
    "MasterShard",
    "build_pieces",
    "counts_replica",
    "flat_shards",
    "prefixed_buffers",
]


@dataclass
class MasterPiece:
    """The part of one parameter inside one owned shard, and its fp32 master view."""

    name: str
    in_param: Range
    master: torch.Tensor  # [piece] fp32, the tensor the wrapped optimizer steps
    grad: torch.Tensor  # [piece] view of the gradient buffer
    counts: bool  # counted in the global gradient norm


@dataclass
class MasterShard:
    """One bucket's owned shard: where the master values are written back from."""

    bucket: Bucket | ShardedBucket
    master: torch.Tensor  # [bucket/dp] fp32; the parameter shard itself for fp32 params
    order: tuple[int, int]  # (buffer, -bucket): the order the forward uses the shards
    host: HostShard | None = None  # optimizer_offload: the host side (master is host.master)
    masters: frozenset[int] = frozenset()  # ids of the pieces' master views in this shard


def prefixed_buffers(
    ddps: Sequence[DistributedDataParallel],
) -> list[tuple[str, ParamAndGradBuffer | ShardedBuffer]]:
    """Every buffer of ``ddps`` with the prefix of its parameters' names (``"i."`` for the
    i-th module when there are several, ``""`` otherwise)."""
    prefixed = len(ddps) > 1
    return [
        (f"{i}." if prefixed else "", buffer)
        for i, ddp in enumerate(ddps)
        for buffer in ddp.param_and_grad_buffers
    ]


def counts_replica(ddp: DistributedDataParallel, grad_norm_group: ProcessGroup | None) -> bool:
    """HSDP: whether this rank's shards count in the gradient norm. Every replica holds
    the same reduced shard; when the norm group spans several replicas only the first
    counts it, so that the sum of squares holds each shard once."""
    if ddp.replicate_group is None or ddp.replicate_size == 1:
        return True
    replicas = dist.get_process_group_ranks(ddp.replicate_group)
    if grad_norm_group is None:
        spanned = len(replicas)
    else:
        spanned = len(set(replicas) & set(dist.get_process_group_ranks(grad_norm_group)))
    return spanned == 1 or dist.get_rank(ddp.replicate_group) == 0


def build_pieces(
    ddps: Sequence[DistributedDataParallel],
    grad_norm_group: ProcessGroup | None,
    offloader: Offloader | None,
    *,
    shapes: dict[str, tuple[int, ...]],
    shards: list[MasterShard],
) -> tuple[dict[int, tuple[str, list[MasterPiece]]], int]:
    """id(param) -> (name, pieces of it this rank owns), and the bytes of the master shards
    it allocates; records every parameter's shape in ``shapes`` and every bucket's owned
    shard in ``shards``."""
    found: dict[int, tuple[str, list[MasterPiece]]] = {}
    master_bytes = 0
    uncounted = {
        id(b)
        for d in ddps
        if not counts_replica(d, grad_norm_group)
        for b in d.param_and_grad_buffers
    }
    for number, (prefix, buffer) in enumerate(prefixed_buffers(ddps)):
        for name, p in zip(buffer.names, buffer.params, strict=True):
            shapes[prefix + name] = tuple(p.shape)
            found[id(p)] = (prefix + name, [])
        fp32 = buffer.param_dtype == torch.float32
        size = sum(b.shard.size for b in buffer.buckets)
        masters = None
        if not fp32 and offloader is None:
            masters = torch.empty(size, dtype=torch.float32, device=buffer.device)
        master_bytes += 0 if masters is None else masters.numel() * 4
        offset = 0
        for bucket in buffer.buckets:
            host = None
            grads = bucket.grad_shard
            if offloader is not None:
                pin = offloader.cuda
                host = HostShard(bucket.param_shard, bucket.grad_shard, pin=pin)
                master, grads = host.master, host.grad
            elif masters is None:
                master = bucket.param_shard
            else:
                master = masters[offset : offset + bucket.shard.size]
                master.copy_(bucket.param_shard)
                offset += bucket.shard.size
            shard = MasterShard(bucket, master, (number, -bucket.index), host)
            shards.append(shard)
            mine: list[int] = []
            for piece in owned_pieces(buffer.ranges, bucket.shard):
                p = buffer.params[piece.index]
                local = piece.in_buffer.shift(bucket.shard.start)
                name, into = found[id(p)]
                into.append(
                    MasterPiece(
                        name=name,
                        in_param=piece.in_param,
                        master=master[local.start : local.end],
                        grad=grads[local.start : local.end],
                        counts=counts_in_norm(p) and id(buffer) not in uncounted,
                    )
                )
                mine.append(id(into[-1].master))
            shard.masters = frozenset(mine)
    return found, master_bytes


def flat_shards(shards: Sequence[MasterShard], pieces: Sequence[MasterPiece]) -> list[FlatShard]:
    """The shards as the flat step sees them, each with the masters of its stepped pieces."""
    stepped = [{id(p.master) for p in pieces} & s.masters for s in shards]
    return [
        FlatShard(
            master=s.master,
            grad=s.bucket.grad_shard,
            low_precision=None
            if s.master.dtype == s.bucket.param_shard.dtype
            else (s.bucket.param_shard),
            pieces=tuple(p.master for p in pieces if id(p.master) in mine),
        )
        for s, mine in zip(shards, stepped, strict=True)
    ]
