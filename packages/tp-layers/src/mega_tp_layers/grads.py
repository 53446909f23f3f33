"""Gradients of replicated parameters used on sequence-parallel activations.

Under sequence parallel a replicated parameter applied to ``[s/tp, b, h]`` activations
(a RowParallelLinear bias, a norm weight) gets only its own sequence slice's share of the
gradient on each rank. Those parameters carry ``param.mega_sequence_parallel = True``;
:func:`sync_sequence_parallel_grads` sums their gradients over tp (coalesced), after
backward and before the gradients are reduced over data parallel or clipped. A gradient
is the parameter's ``main_grad`` where a data-parallel wrapper gave it one (mega-zero-optim's
``DistributedDataParallel``), else its ``grad``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from mega_tp_layers._comm import all_reduce, group_size

__all__ = [
    "SEQUENCE_PARALLEL_ATTR",
    "all_reduce_coalesced",
    "gradient_of",
    "mark_sequence_parallel",
    "sync_sequence_parallel_grads",
]

#: Name of the attribute that marks a parameter whose gradient is partial over tp under SP.
SEQUENCE_PARALLEL_ATTR = "mega_sequence_parallel"


def mark_sequence_parallel(param: Tensor) -> None:
    """Mark ``param`` as replicated over tp and applied to sequence-parallel activations."""
    setattr(param, SEQUENCE_PARALLEL_ATTR, True)


def gradient_of(param: nn.Parameter) -> Tensor | None:
    """Where ``param``'s gradient lives: ``main_grad`` under mega-zero-optim's DDP, else ``grad``."""
    main = getattr(param, "main_grad", None)
    return main if isinstance(main, Tensor) else param.grad


def all_reduce_coalesced(tensors: Sequence[Tensor], group: ProcessGroup) -> None:
    """Sum ``tensors`` in place over ``group``: one flat all-reduce per (dtype, device)."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for same in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        all_reduce(flat, group)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


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
        g for p in found
        if getattr(p, SEQUENCE_PARALLEL_ATTR, False) and (g := gradient_of(p)) is not None
    ]  # fmt: skip
    all_reduce_coalesced(grads, tp_group)
    return len(grads)
