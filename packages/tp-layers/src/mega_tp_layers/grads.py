"""Gradients of replicated parameters used on sequence-parallel activations.

Under sequence parallel a replicated parameter applied to ``[s/tp, b, h]`` activations
(a RowParallelLinear bias, a norm weight) gets only its own sequence slice's share of the
gradient on each rank. Those parameters carry ``param.mega_sequence_parallel = True``;
:func:`sync_sequence_parallel_grads` sums their gradients over tp (coalesced), after
backward and before the gradients are reduced over data parallel or clipped.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from mega_tp_layers._comm import all_reduce, group_size

__all__ = ["SEQUENCE_PARALLEL_ATTR", "mark_sequence_parallel", "sync_sequence_parallel_grads"]

#: Name of the attribute that marks a parameter whose gradient is partial over tp under SP.
SEQUENCE_PARALLEL_ATTR = "mega_sequence_parallel"


def mark_sequence_parallel(param: Tensor) -> None:
    """Mark ``param`` as replicated over tp and applied to sequence-parallel activations."""
    setattr(param, SEQUENCE_PARALLEL_ATTR, True)


def sync_sequence_parallel_grads(
    params: nn.Module | Iterable[nn.Parameter], tp_group: ProcessGroup
) -> int:
    """Sum over ``tp_group`` the gradients of every marked parameter (one all-reduce per dtype).

    Returns how many gradients were summed (none, and no collective, for tp = 1).
    """
    if group_size(tp_group) == 1:
        return 0
    found = params.parameters() if isinstance(params, nn.Module) else params
    grads = [
        p.grad for p in found if getattr(p, SEQUENCE_PARALLEL_ATTR, False) and p.grad is not None
    ]
    by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for g in grads:
        by_dtype.setdefault((g.dtype, g.device), []).append(g)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        all_reduce(flat, tp_group)
        offset = 0
        for g in group:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(grads)
