"""After backward, before the optimizer: the gradient sums the model's parallel layout needs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from mega_parallel_grid import ProcessGroups
from mega_tp_layers import SEQUENCE_PARALLEL_ATTR

__all__ = ["finalize_model_grads", "gradient_of"]


def gradient_of(param: nn.Parameter) -> torch.Tensor | None:
    """Where ``param``'s gradient lives: ``main_grad`` under mega-zero-optim's DDP, else ``grad``."""
    main = getattr(param, "main_grad", None)
    return main if isinstance(main, torch.Tensor) else param.grad


def _all_reduce_flat(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.dtype, g.device), []).append(g)
    for same in by_kind.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def finalize_model_grads(chunks: nn.Module | Sequence[nn.Module], groups: ProcessGroups) -> None:
    """Sum partial gradients: replicated params under SP over tp, tied embeddings over pp.

    Under sequence parallelism (and for QK-norm) each tp rank holds part of a replicated
    parameter's gradient; with tied embeddings and pp > 1 the first and last stage each
    hold part of the embedding's. Works on ``main_grad`` (mega-zero-optim's DDP, after
    ``finish_grad_sync``) or ``grad``. Data-parallel reduction is the DDP's job.
    """
    modules = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
    params = [p for m in modules for p in m.parameters()]
    if groups.size("tp") > 1:
        partial = [
            g for p in params
            if getattr(p, SEQUENCE_PARALLEL_ATTR, False) and (g := gradient_of(p)) is not None
        ]  # fmt: skip
        if partial:
            _all_reduce_flat(partial, groups.tp)
    if groups.size("pp") == 1 or dist.get_world_size(groups.embedding) == 1:
        return
    tied: list[torch.Tensor] = []
    for m in modules:
        if not getattr(getattr(m, "config", None), "tie_embeddings", False):
            continue
        for name, p in m.named_parameters():
            grad = gradient_of(p)
            if name == "embedding.word.weight" and grad is not None:
                tied.append(grad)
    if tied:
        _all_reduce_flat(tied, groups.embedding)
