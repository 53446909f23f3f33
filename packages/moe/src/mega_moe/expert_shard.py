"""Shard metadata of expert weights: which experts a rank holds, and its etp slice of each.

An expert parameter carries two descriptions. ``param.mega_shard`` (a
:class:`mega_tp_layers.ShardSpec`) describes one split: the ep split of the expert
dimension for GroupedMLP's stacked ``[E/ep, ...]`` weights (its ``full_shape`` is the
tensor the ep group holds, i.e. already cut by etp), the etp split for one
SequentialMLP expert. ``param.mega_expert`` (an :class:`ExpertShard`) describes both, and
marks the parameter as an expert parameter (its gradients are reduced over the expert
data-parallel group ``edp``, not over dp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mega_moe._comm import Group, all_gather_no_grad, group_size

__all__ = ["EXPERT_ATTR", "ExpertShard", "expert_shard", "gather_expert_weight"]

#: Name of the parameter attribute that holds the :class:`ExpertShard`.
EXPERT_ATTR = "mega_expert"


@dataclass(frozen=True)
class ExpertShard:
    """Where an expert parameter's local tensor sits in the full ``[E, *expert_shape]``."""

    num_experts: int
    """E, the experts of the layer."""
    first_expert: int
    """Global index of the first expert held here."""
    num_local: int
    """Experts held here (``E / ep`` stacked, or 1 for a SequentialMLP expert)."""
    stacked: bool
    """True: the local tensor's dim 0 enumerates the local experts (GroupedMLP)."""
    expert_shape: tuple[int, ...]
    """Full shape of one expert's tensor (before the etp split)."""
    etp_dim: int
    """Dimension of one expert's tensor split over etp."""
    ep: int
    """Expert-parallel size."""
    ep_rank: int
    """This rank's index in the ep group."""
    etp: int
    """Expert tensor-parallel size."""
    etp_rank: int
    """This rank's index in the etp group."""

    @property
    def experts(self) -> range:
        """Global indices of the experts held here."""
        return range(self.first_expert, self.first_expert + self.num_local)


def expert_shard(param: Tensor) -> ExpertShard | None:
    """The :class:`ExpertShard` of ``param``, or None for a non-expert parameter."""
    shard = getattr(param, EXPERT_ATTR, None)
    return shard if isinstance(shard, ExpertShard) else None


def gather_expert_weight(param: Tensor, ep_group: Group, etp_group: Group) -> Tensor:
    """Rebuild the full weight: ``[E, *expert_shape]`` for stacked, else ``expert_shape``.

    Collective over ``etp_group`` (and ``ep_group`` for stacked weights): every rank of
    them must call it.
    """
    shard = expert_shard(param)
    if shard is None:
        raise ValueError(
            "gather_expert_weight needs an expert parameter (one with mega_expert metadata); "
            "pass a weight of SequentialMLP or GroupedMLP"
        )
    local = param.detach()
    dim = shard.etp_dim + (1 if shard.stacked else 0)
    for what, size, group in (("etp", shard.etp, etp_group), ("ep", shard.ep, ep_group)):
        if group_size(group) != size and (what == "etp" or shard.stacked):
            raise ValueError(
                f"{what}_group has {group_size(group)} ranks but the weight is split {size} "
                f"ways over {what}; pass the group the layer was built with"
            )
    if shard.etp > 1:
        local = torch.cat(all_gather_no_grad(local, etp_group).unbind(0), dim=dim)
    if shard.stacked and shard.ep > 1:
        local = torch.cat(all_gather_no_grad(local, ep_group).unbind(0), dim=0)
    return local.clone()
