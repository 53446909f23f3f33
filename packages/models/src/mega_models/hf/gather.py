"""Full (unsharded) tensors of a GPTModel: over tp by all-gather, over pp onto the first stage."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from mega_models.gpt import GPTModel
from mega_tp_layers import gather_full, shard_spec

__all__ = ["gather_full_state"]

_VOCAB = ("embedding.word.weight", "output.weight")


def _as_list(models: GPTModel | Sequence[GPTModel]) -> list[GPTModel]:
    return [models] if isinstance(models, GPTModel) else list(models)


def gather_full_state(
    models: GPTModel | Sequence[GPTModel], pp_group: ProcessGroup | None = None
) -> dict[str, Tensor] | None:
    """Every parameter of ``models`` as a full CPU tensor, vocabulary padding cut.

    ``models`` is this rank's GPTModel, or its virtual-pipeline chunks. Collective over
    each model's tp group (every tp rank calls; each gets the full tensors). With a
    ``pp_group`` of more than one rank, the stages' tensors are also sent to the group's
    first rank (collective over pp), which returns the whole model; the other stages
    return None. A size-1 group costs nothing. The result feeds
    :func:`~mega_models.hf.save_hf_checkpoint` on one rank.
    """
    state: dict[str, Tensor] = {}
    for model in _as_list(models):
        vocab = model.config.vocab_size
        for name, param in model.named_parameters():
            spec = shard_spec(param)
            if spec is None:
                raise ValueError(f"parameter {name} has no shard spec; build it with GPTModel")
            full = gather_full(param.detach(), spec, model.tp_group).cpu()
            if name in _VOCAB:
                full = full[:vocab].clone()  # [V_pad, h] -> [V, h]
            state.setdefault(name, full)  # a tied last stage repeats the embedding
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return state
    first = dist.get_global_rank(pp_group, 0)
    mine = dist.get_rank(pp_group) == 0
    gathered: list[object] | None = [None] * dist.get_world_size(pp_group) if mine else None
    dist.gather_object(state, gathered, dst=first, group=pp_group)
    if gathered is None:
        return None
    merged: dict[str, Tensor] = {}
    for part in gathered:
        assert isinstance(part, dict)
        for name, tensor in part.items():
            merged.setdefault(name, tensor)
    return merged
