"""Full (unsharded) tensors of a GPTModel: over tp and the expert groups by all-gather, over pp
onto the first stage."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from mega_models.gpt import GPTModel
from mega_moe import expert_shard, gather_expert_weight
from mega_tp_layers import gather_full, shard_spec

__all__ = ["gather_full_state"]

_VOCAB = ("embedding.word.weight", "output.weight")


def _as_list(models: GPTModel | Sequence[GPTModel]) -> list[GPTModel]:
    return [models] if isinstance(models, GPTModel) else list(models)


def _model_state(model: GPTModel) -> dict[str, Tensor]:
    """This model's full tensors, on every rank of its tp, etp and ep groups."""
    state: dict[str, Tensor] = {}
    spread: dict[str, Tensor] = {}  # SequentialMLP experts: each ep rank holds its own
    vocab = model.config.vocab_size
    for name, param in model.named_parameters():
        spec = shard_spec(param)
        if spec is None:
            raise ValueError(f"parameter {name} has no shard spec; build it with GPTModel")
        shard = expert_shard(param)
        if shard is not None:  # stacked: [E/ep, ...] -> [E, ...]; both: etp slices joined
            full = gather_expert_weight(param, model.groups.ep, model.groups.etp).cpu()
            if not shard.stacked and shard.ep > 1:
                spread[name] = full
                continue
        else:
            full = gather_full(param.detach(), spec, model.tp_group).cpu()
        if name in _VOCAB:
            full = full[:vocab].clone()  # [V_pad, h] -> [V, h]
        state[name] = full
    for name, buffer in model.named_buffers():  # the routers' aux-loss-free biases
        if name.endswith("router.expert_bias"):
            state[name] = buffer.detach().cpu().clone()
    if spread:  # collective over ep: every rank of it has SequentialMLP experts here
        parts: list[object] = [None] * dist.get_world_size(model.groups.ep)
        dist.all_gather_object(parts, spread, group=model.groups.ep)
        for part in parts:
            assert isinstance(part, dict)
            state.update(part)
    return state


def gather_full_state(
    models: GPTModel | Sequence[GPTModel], pp_group: ProcessGroup | None = None
) -> dict[str, Tensor] | None:
    """Every parameter of ``models`` as a full CPU tensor, vocabulary padding cut, and the
    routers' expert biases (buffers, replicated).

    ``models`` is this rank's GPTModel, or its virtual-pipeline chunks. Collective over
    each model's tp group and, for MoE layers, its etp and ep groups (every rank of them
    calls; each gets the full tensors, every expert included). With a ``pp_group`` of
    more than one rank, the stages' tensors are also sent to the group's first rank
    (collective over pp), which returns the whole model; the other stages return None.
    A size-1 group costs nothing. The result feeds
    :func:`~mega_models.hf.save_hf_checkpoint` on one rank.
    """
    state: dict[str, Tensor] = {}
    for model in _as_list(models):
        for name, full in _model_state(model).items():
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
