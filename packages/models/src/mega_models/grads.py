"""After backward, before the optimizer: the gradient sums the model's parallel layout needs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from mega_parallel_grid import ProcessGroups
from mega_tp_layers import (
    SEQUENCE_PARALLEL_ATTR,
    all_reduce_coalesced,
    gradient_of,
    sync_sequence_parallel_grads,
)

__all__ = ["finalize_model_grads", "gradient_of"]


def finalize_model_grads(chunks: nn.Module | Sequence[nn.Module], groups: ProcessGroups) -> None:
    """Sum partial gradients: replicated params under SP over tp, shared embeddings over pp.

    Under sequence parallelism (and for QK-norm) each tp rank holds part of a replicated
    parameter's gradient; with tied embeddings or multi-token prediction and pp > 1 the
    first and last stage each hold part of the embedding's (summed over the embedding group,
    or on this rank when it holds both end stages, as the V schedules place them). Works on
    ``main_grad`` (mega-zero-optim's DDP, after ``finish_grad_sync``) or ``grad``.
    Data-parallel reduction is the DDP's job.
    """
    modules = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
    params = [p for m in modules for p in m.parameters()]
    if groups.size("tp") > 1:
        _check_whole(
            (n, p) for m in modules for n, p in m.named_parameters()
            if getattr(p, SEQUENCE_PARALLEL_ATTR, False)
        )  # fmt: skip
    sync_sequence_parallel_grads(params, groups.tp)  # replicated params under SP: sum over tp
    if groups.size("pp") == 1 or dist.get_world_size(groups.embedding) == 1:
        return
    tied: list[torch.Tensor] = []
    for m in modules:
        shared = getattr(m, "shared_embedding", None)  # GPTModel: tied or MTP
        if shared is None:
            shared = getattr(getattr(m, "config", None), "tie_embeddings", False)
        if not shared:
            continue
        for name, p in m.named_parameters():
            grad = gradient_of(p)
            if name == "embedding.word.weight" and grad is not None:
                _check_whole([(name, p)])
                tied.append(grad)
    if len(tied) > 1:  # the V schedules: both end stages are chunks of this rank
        total = torch.stack(tied).sum(0)
        for grad in tied:
            grad.copy_(total)
    elif tied:
        all_reduce_coalesced(tied, groups.embedding)


def _check_whole(named: Iterable[tuple[str, nn.Parameter]]) -> None:
    """Raise when a gradient to be summed was freed (ZeRO-2/3 keep only a dp shard of it)."""
    for name, p in named:
        grad = gradient_of(p)
        if grad is not None and grad.numel() and grad.untyped_storage().nbytes() == 0:
            raise RuntimeError(
                f"the gradient of {name!r} was freed after its dp reduce-scatter (ZeRO-2/3), "
                "so it cannot be summed over tp or pp; wrap such parameters in a "
                "DistributedDataParallel of sharding='optimizer' (mega_pretrain.build does)"
            )
