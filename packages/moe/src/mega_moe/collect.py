"""Model-level helpers: sum the router losses, read the load, update every expert bias."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mega_moe._comm import Group, all_reduce
from mega_moe.layer import MoELayer

__all__ = ["moe_aux_loss", "moe_tokens_per_expert", "update_expert_biases"]


def _layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def moe_aux_loss(model: nn.Module) -> Tensor | None:
    """The sum of ``last_stats.loss`` over the MoE layers of ``model`` (None if none ran)."""
    losses = [m.last_stats.loss for m in _layers(model) if m.last_stats is not None]
    if not losses:
        return None
    return torch.stack(losses).sum()


def moe_tokens_per_expert(model: nn.Module) -> Tensor | None:
    """``[layers, E]``: each MoE layer's last per-expert token counts on this rank.

    Sum it over the data-parallel ranks for the global load; ``max / mean`` per layer is
    the usual imbalance figure. None when no MoE layer ran.
    """
    counts = [m.last_stats.tokens_per_expert for m in _layers(model) if m.last_stats is not None]
    if not counts:
        return None
    return torch.stack(counts)


@torch.no_grad()
def update_expert_biases(model: nn.Module, group: Group = None) -> None:
    """:meth:`TopKRouter.update_expert_bias` for every MoE layer, with one all-reduce.

    Call it after each optimizer step, on every rank of ``group`` (all the ranks that hold
    a replica of the routers, e.g. ``tp_dp_cp``).
    """
    routers = [m.router for m in _layers(model) if m.router.expert_bias is not None]
    if not routers:
        return
    loads = all_reduce(torch.stack([r.load.float() for r in routers]), group)  # [layers, E]
    for router, load in zip(routers, loads.unbind(0), strict=True):
        router.apply_load(load)
