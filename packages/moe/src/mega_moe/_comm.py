"""Collectives on token blocks of uneven size, and the all-to-all with its autograd dual.

A group may be None (one rank, no torch.distributed needed); every helper then returns
its input and issues nothing. Uneven all-gathers and reduce-scatters pad each rank's
block to the largest one and reuse mega_tp_layers' sequence-parallel mappings. ``Group``, ``group_size`` and ``group_rank`` are
mega_parallel_grid's, re-exported here for the modules of this package.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function
from torch.distributed import ProcessGroup

from mega_parallel_grid import Group, group_rank, group_size
from mega_tp_layers import gather_from_sequence_region, reduce_scatter_to_sequence_region

__all__ = [
    "Group",
    "all_gather_no_grad",
    "all_gather_sizes",
    "all_reduce",
    "all_to_all",
    "all_to_all_no_grad",
    "check_group",
    "gather_rows",
    "gather_rows_no_grad",
    "group_rank",
    "group_size",
    "reduce_scatter_rows",
]


def check_group(group: object, name: str, owner: str) -> Group:
    """Reject anything that is neither None nor a process group, in one sentence."""
    if group is not None and not isinstance(group, ProcessGroup):
        raise TypeError(
            f"{owner} needs {name} to be a torch.distributed ProcessGroup or None (one rank), "
            f"got {type(group).__name__}; pass a group from init_process_groups(config)"
        )
    return group


def all_reduce(t: Tensor, group: Group) -> Tensor:
    """Sum ``t`` in place over ``group`` (nothing for a one-rank group); returns ``t``."""
    if group_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def all_gather_sizes(n: int, group: Group, device: torch.device) -> list[int]:
    """Every rank's ``n``, in rank order (one small all-gather and a host sync)."""
    size = group_size(group)
    if size == 1:
        return [n]
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    every = torch.empty(size, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine, group=group)
    return [int(v) for v in every.tolist()]


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    if x.shape[0] == rows:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, rows - x.shape[0]))


def gather_rows(x: Tensor, sizes: list[int], group: Group) -> Tensor:
    """Concatenate every rank's ``x`` along dim 0 (rank r holds ``sizes[r]`` rows).

    Backward: the gradient rows of each rank are summed over ranks and returned to it.
    """
    if group_size(group) == 1:
        return x
    assert group is not None and x.shape[0] == sizes[group_rank(group)]
    most = max(sizes)
    full = gather_from_sequence_region(_pad_rows(x, most), group)  # [n, ...] -> [T*most, ...]
    if all(n == most for n in sizes):
        return full
    return torch.cat([full[r * most : r * most + n] for r, n in enumerate(sizes)])


def reduce_scatter_rows(y: Tensor, sizes: list[int], group: Group) -> Tensor:
    """Sum ``y`` (blocks of ``sizes`` rows, one per rank) over ranks; keep this rank's block.

    The dual of :func:`gather_rows`; backward all-gathers the gradient.
    """
    if group_size(group) == 1:
        return y
    assert group is not None and y.shape[0] == sum(sizes)
    most = max(sizes)
    if any(n != most for n in sizes):
        y = torch.cat([_pad_rows(block, most) for block in torch.split(y, sizes)])
    out = reduce_scatter_to_sequence_region(y, group)  # [T*most, ...] -> [most, ...]
    return out[: sizes[group_rank(group)]]


def gather_rows_no_grad(x: Tensor, sizes: list[int], group: Group) -> Tensor:
    """:func:`gather_rows` for tensors without gradient (bool masks travel as uint8)."""
    if group_size(group) == 1:
        return x
    dtype = x.dtype
    t = x.to(torch.uint8) if dtype == torch.bool else x
    most = max(sizes)
    t = _pad_rows(t.contiguous(), most)
    full = torch.empty((len(sizes) * most, *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(full, t, group=group)
    if any(n != most for n in sizes):
        full = torch.cat([full[r * most : r * most + n] for r, n in enumerate(sizes)])
    return full.to(dtype) if dtype == torch.bool else full


class _AllToAll(Function):
    """fwd: all-to-all with split sizes (optionally asynchronous) · bwd: the reverse all-to-all"""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: ProcessGroup,
        pending: list[dist.Work] | None,
    ) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        x = x.contiguous()
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        work = dist.all_to_all_single(
            out, x, out_splits, in_splits, group=group, async_op=pending is not None
        )
        if pending is not None:
            assert work is not None
            pending.append(work)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        grad = grad.contiguous()
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad, in_splits, out_splits, group=ctx.group)
        return back, None, None, None, None


def all_to_all(
    x: Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: Group,
    pending: list[dist.Work] | None = None,
) -> Tensor:
    """Send ``in_splits[r]`` rows of ``x`` to rank r; receive ``out_splits[r]`` rows from it.

    With ``pending`` the collective is issued asynchronously: its handle is appended to
    ``pending`` and the result must not be read before ``handle.wait()``.
    """
    if group_size(group) == 1:
        return x
    assert group is not None
    out: Tensor = _AllToAll.apply(x, out_splits, in_splits, group, pending)
    return out


def all_to_all_no_grad(x: Tensor, group: Group) -> Tensor:
    """Equal-split all-to-all of a small tensor ``[ranks, ...]`` (row r goes to rank r)."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def all_gather_no_grad(x: Tensor, group: Group) -> Tensor:
    """Stack every rank's ``x`` (same shape everywhere): ``[...] -> [ranks, ...]``."""
    size = group_size(group)
    if size == 1:
        return x.unsqueeze(0)
    flat = x.contiguous().view(-1)
    out = torch.empty(size * flat.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, flat, group=group)
    return out.view(size, *x.shape)
