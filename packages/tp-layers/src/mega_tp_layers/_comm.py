"""Raw collectives on contiguous memory, shared by the mappings and the layers.

Every helper calls ``torch.distributed`` through the module attribute at call time (so a
test can count the calls) and assumes a group of more than one rank: callers return early
for size-1 groups, which therefore issue nothing. ``group_size`` and ``group_rank`` are
mega_parallel_grid's, re-exported here for the modules of this package.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from mega_parallel_grid import group_rank, group_size

__all__ = [
    "all_gather_dim0",
    "all_gather_last_dim",
    "all_reduce",
    "all_reduce_max",
    "check_divisible_dim0",
    "check_group",
    "group_rank",
    "group_size",
    "reduce_scatter_dim0",
    "ring_shift",
    "split_last_dim",
]


def check_group(tp_group: object, owner: str) -> ProcessGroup:
    """Reject anything that is not a process group, in one sentence."""
    if not isinstance(tp_group, ProcessGroup):
        raise TypeError(
            f"{owner} needs tp_group to be a torch.distributed ProcessGroup, got "
            f"{type(tp_group).__name__}; pass e.g. init_process_groups(config).tp"
        )
    return tp_group


def check_divisible_dim0(x: Tensor, size: int, what: str) -> None:
    """Raise one sentence when dim 0 (the sequence) cannot be split ``size`` ways."""
    if x.dim() == 0:
        raise ValueError(
            f"{what} needs a tensor with a leading sequence dimension, got a 0-d tensor; "
            "pass sequence-first activations [s, b, h]"
        )
    if x.shape[0] % size != 0:
        raise ValueError(
            f"sequence length ({x.shape[0]}) is not divisible by tp ({size}) in {what}; "
            f"pad the sequence to a multiple of {size} or turn sequence_parallel off"
        )


def all_reduce(x: Tensor, group: ProcessGroup, async_op: bool = False) -> dist.Work | None:
    """Sum ``x`` in place across ``group``; returns the handle when ``async_op``."""
    return dist.all_reduce(x, group=group, async_op=async_op)


def all_reduce_max(x: Tensor, group: ProcessGroup, async_op: bool = False) -> dist.Work | None:
    """Elementwise maximum of ``x`` in place across ``group`` (exact in any dtype)."""
    return dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group, async_op=async_op)


def ring_shift(send: Tensor, recv: Tensor, group: ProcessGroup) -> list[dist.Work]:
    """Send ``send`` to the next rank of ``group`` and receive ``recv`` from the previous one.

    Asynchronous: the handles are returned; ``send`` must stay untouched and ``recv``
    unread until they are waited. Both are contiguous tensors of equal shape.
    """
    size, rank = group_size(group), group_rank(group)
    ops = [
        dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % size),
        dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % size),
    ]
    return dist.batch_isend_irecv(ops)


def all_gather_dim0(
    x: Tensor, group: ProcessGroup, async_op: bool = False
) -> tuple[Tensor, dist.Work | None]:
    """Concatenate every rank's ``x`` along dim 0: ``[n, ...] -> [n*size, ...]``."""
    x = x.contiguous()
    out = torch.empty(
        (x.shape[0] * group_size(group), *x.shape[1:]), dtype=x.dtype, device=x.device
    )
    work = dist.all_gather_into_tensor(out, x, group=group, async_op=async_op)
    return out, work


def reduce_scatter_dim0(
    x: Tensor, group: ProcessGroup, async_op: bool = False
) -> tuple[Tensor, dist.Work | None]:
    """Sum across ranks and keep this rank's slice of dim 0: ``[n, ...] -> [n/size, ...]``."""
    size = group_size(group)
    assert x.shape[0] % size == 0, "callers check divisibility"
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = dist.reduce_scatter_tensor(out, x, group=group, async_op=async_op)
    return out, work


def all_gather_last_dim(x: Tensor, group: ProcessGroup) -> Tensor:
    """Concatenate every rank's ``x`` along the last dim: ``[..., n] -> [..., n*size]``."""
    stacked, _ = all_gather_dim0(x.unsqueeze(0), group)  # [size, ..., n]
    return torch.cat(stacked.unbind(0), dim=-1)


def split_last_dim(x: Tensor, group: ProcessGroup) -> Tensor:
    """This rank's contiguous slice of the last dim: ``[..., n] -> [..., n/size]``."""
    size = group_size(group)
    if x.shape[-1] % size != 0:
        raise ValueError(
            f"last dimension ({x.shape[-1]}) is not divisible by tp ({size}); "
            f"make the split dimension a multiple of {size}"
        )
    return x.chunk(size, dim=-1)[group_rank(group)].contiguous()
