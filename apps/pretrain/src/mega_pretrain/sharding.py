"""``parallel.sharding`` (ZeRO-1/2/3) checked against the rest of the config, one sentence each.

The stages themselves live in mega-zero-optim (``DistributedDataParallel(sharding=...)``);
:func:`mega_pretrain.build.build` wires them. What the trainer cannot run yet is refused
here, before any process group exists. ``train.compile`` composes with every stage: ZeRO-3's
gather hooks run outside each compiled layer (see :mod:`mega_zero_optim.gather`).
"""

from __future__ import annotations

from mega_models import GPTConfig
from mega_pretrain.config import TrainerConfig

__all__ = ["check_sharding"]


def check_sharding(config: TrainerConfig, model: GPTConfig) -> None:
    """Raise ValueError for a ``parallel.sharding`` that this config cannot train with."""
    p = config.parallel
    stage = p.zero_stage
    if p.dp_shard is not None and model.is_moe:
        # experts shard within the part of edp inside one replica of tp*cp*dp_shard ranks
        # (RankLayout's edp_shard), which needs one of the two to divide the other
        pc = p.parallel_config()
        experts, replica = pc.ep * pc.expert_tp, pc.tp * pc.cp * p.dp_shard
        if replica % experts and experts % replica:
            raise ValueError(
                f"parallel.dp_shard ({p.dp_shard}) with an MoE model needs ep*etp "
                f"({pc.ep}*{pc.expert_tp} = {experts}) and tp*cp*dp_shard ({pc.tp}*{pc.cp}*"
                f"{p.dp_shard} = {replica}) to divide one another, so that each expert shard "
                "group lies inside one replica; choose a dp_shard for which they do"
            )
    if p.optimizer_offload and not p.distributed_optimizer:
        raise ValueError(
            "parallel.optimizer_offload moves the distributed optimizer's fp32 shards to the "
            "host, but parallel.distributed_optimizer is false; turn it on (at dp 1 it shards "
            "nothing and costs nothing)"
        )
    if stage == "optimizer":
        return
    asked = f"parallel.sharding {p.sharding!r}"
    if not p.distributed_optimizer:
        raise ValueError(
            f"{asked} shards the gradients over dp, which needs parallel.distributed_optimizer "
            "true (false all-reduces whole gradients); turn it on or use sharding 'optimizer'"
        )
    if stage != "parameters":
        return
    if p.overlap_param_gather:
        raise ValueError(
            f"parallel.overlap_param_gather does not apply to {asked} (ZeRO-3 gathers each "
            "layer's parameters before its forward, prefetching the next); turn it off"
        )
