"""After backward, before the optimizer: the gradient sums the model's parallel layout needs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from mega_parallel_grid import ProcessGroups
from mega_tp_layers import sync_sequence_parallel_grads

__all__ = ["finalize_model_grads"]


def finalize_model_grads(chunks: nn.Module | Sequence[nn.Module], groups: ProcessGroups) -> None:
    """Sum partial gradients: replicated params under SP over tp, tied embeddings over pp.

    Under sequence parallelism (and for QK-norm) each tp rank holds part of a replicated
    parameter's gradient; with tied embeddings and pp > 1 the first and last stage each
    hold part of the embedding's. Data-parallel reduction is not done here (that is the
    data-parallel wrapper's job).
    """
    modules = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
    for module in modules:
        sync_sequence_parallel_grads(module, groups.tp)
    if groups.size("pp") == 1:
        return
    if dist.get_world_size(groups.embedding) == 1:
        return
    tied = [
        p
        for m in modules
        if getattr(getattr(m, "config", None), "tie_embeddings", False)
        for name, p in m.named_parameters()
        if name == "embedding.word.weight"
    ]
    for p in tied:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=groups.embedding)
