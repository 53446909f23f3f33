"""The tensor- and sequence-parallel autograd mappings, each the backward dual of another.

Tensor parallel (last dim): ``copy_to_tp_region`` / ``reduce_from_tp_region`` and
``scatter_to_tp_region`` / ``gather_from_tp_region``. Sequence parallel (dim 0 of
sequence-first ``[s, b, h]`` activations): ``scatter_to_sequence_region`` /
``gather_from_sequence_region`` and ``reduce_scatter_to_sequence_region`` (dual of the
all-gather). With a size-1 group every mapping returns its input itself: no collective,
no copy.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.autograd import Function
from torch.distributed import ProcessGroup

from mega_tp_layers._comm import (
    all_gather_dim0,
    all_gather_last_dim,
    all_reduce,
    check_divisible_dim0,
    group_rank,
    group_size,
    reduce_scatter_dim0,
    split_last_dim,
)

__all__ = [
    "copy_to_tp_region",
    "gather_from_sequence_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_region",
    "scatter_to_tp_region",
]


def _split_dim0(x: Tensor, group: ProcessGroup, what: str) -> Tensor:
    size = group_size(group)
    check_divisible_dim0(x, size, what)
    return x.chunk(size, dim=0)[group_rank(group)].contiguous()


class _CopyToTPRegion(Function):
    """fwd: identity · bwd: all-reduce"""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromTPRegion(Function):
    """fwd: all-reduce · bwd: identity"""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, inplace: bool) -> Tensor:
        if inplace and x.is_contiguous():
            all_reduce(x, group)
            ctx.mark_dirty(x)
            return x
        out = x.contiguous().clone()
        all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad, None, None


class _ScatterToTPRegion(Function):
    """fwd: keep this rank's slice of the last dim · bwd: all-gather along the last dim"""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return split_last_dim(x, group)  # [..., h] -> [..., h/tp]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return all_gather_last_dim(grad, ctx.group), None  # [..., h/tp] -> [..., h]


class _GatherFromTPRegion(Function):
    """fwd: all-gather along the last dim · bwd: keep this rank's slice of the last dim"""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return all_gather_last_dim(x, group)  # [..., h/tp] -> [..., h]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return split_last_dim(grad, ctx.group), None  # [..., h] -> [..., h/tp]


class _ScatterToSequenceRegion(Function):
    """fwd: keep this rank's slice of dim 0 · bwd: all-gather along dim 0"""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return _split_dim0(x, group, "scatter_to_sequence_region")  # [s, b, h] -> [s/tp, b, h]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        full, _ = all_gather_dim0(grad, ctx.group)  # [s/tp, b, h] -> [s, b, h]
        return full, None


class _GatherFromSequenceRegion(Function):
    """fwd: all-gather along dim 0 · bwd: reduce-scatter along dim 0 (or keep the slice)"""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, tp_output_grad: bool) -> Tensor:
        ctx.group = group
        ctx.tp_output_grad = tp_output_grad
        full, _ = all_gather_dim0(x, group)  # [s/tp, b, h] -> [s, b, h]
        return full

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        if ctx.tp_output_grad:  # each rank holds a partial gradient: sum, keep the slice
            out, _ = reduce_scatter_dim0(grad, ctx.group)  # [s, b, h] -> [s/tp, b, h]
        else:  # every rank holds the same full gradient
            out = _split_dim0(grad, ctx.group, "gather_from_sequence_region backward")
        return out, None, None


class _ReduceScatterToSequenceRegion(Function):
    """fwd: reduce-scatter along dim 0 · bwd: all-gather along dim 0"""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        check_divisible_dim0(x, group_size(group), "reduce_scatter_to_sequence_region")
        out, _ = reduce_scatter_dim0(x, group)  # [s, b, h] -> [s/tp, b, h]
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        full, _ = all_gather_dim0(grad, ctx.group)  # [s/tp, b, h] -> [s, b, h]
        return full, None


def copy_to_tp_region(x: Tensor, group: ProcessGroup) -> Tensor:
    """Enter the tensor-parallel region: identity forward, all-reduce of the gradient."""
    if group_size(group) == 1:
        return x
    out: Tensor = _CopyToTPRegion.apply(x, group)
    return out


def reduce_from_tp_region(x: Tensor, group: ProcessGroup) -> Tensor:
    """Leave the tensor-parallel region: sum the partial results (into a new tensor)."""
    if group_size(group) == 1:
        return x
    out: Tensor = _ReduceFromTPRegion.apply(x, group, False)
    return out


def reduce_from_tp_region_inplace(x: Tensor, group: ProcessGroup) -> Tensor:
    """Like :func:`reduce_from_tp_region`, summing into ``x`` itself (a fresh GEMM output)."""
    if group_size(group) == 1:
        return x
    out: Tensor = _ReduceFromTPRegion.apply(x, group, True)
    return out


def scatter_to_tp_region(x: Tensor, group: ProcessGroup) -> Tensor:
    """Keep this rank's slice of the last dim; the gradient is all-gathered back."""
    if group_size(group) == 1:
        return x
    out: Tensor = _ScatterToTPRegion.apply(x, group)
    return out


def gather_from_tp_region(x: Tensor, group: ProcessGroup) -> Tensor:
    """All-gather the last dim; the gradient is split back to this rank's slice."""
    if group_size(group) == 1:
        return x
    out: Tensor = _GatherFromTPRegion.apply(x, group)
    return out


def scatter_to_sequence_region(x: Tensor, group: ProcessGroup) -> Tensor:
    """Keep this rank's slice of the sequence (dim 0); the gradient is all-gathered back."""
    if group_size(group) == 1:
        return x
    out: Tensor = _ScatterToSequenceRegion.apply(x, group)
    return out


def gather_from_sequence_region(
    x: Tensor, group: ProcessGroup, *, tensor_parallel_output_grad: bool = True
) -> Tensor:
    """All-gather the sequence (dim 0).

    Backward reduce-scatters the gradient when the gathered tensor feeds tensor-parallel
    compute (each rank's gradient is partial, the default), or keeps this rank's slice
    when every rank computed the same thing (``tensor_parallel_output_grad=False``).
    """
    if group_size(group) == 1:
        return x
    out: Tensor = _GatherFromSequenceRegion.apply(x, group, tensor_parallel_output_grad)
    return out


def reduce_scatter_to_sequence_region(x: Tensor, group: ProcessGroup) -> Tensor:
    """Sum the partial results and keep this rank's slice of the sequence (dim 0)."""
    if group_size(group) == 1:
        return x
    out: Tensor = _ReduceScatterToSequenceRegion.apply(x, group)
    return out
