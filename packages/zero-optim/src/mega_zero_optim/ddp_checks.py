"""The checks of :class:`~mega_zero_optim.ddp.DistributedDataParallel`'s arguments.

Each raises ValueError, in one sentence naming the values and the way out, for a request
that cannot work, before the wrapper builds anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

__all__ = ["SHARDING", "check_grad_reduction", "check_replicate_group", "check_sharding"]

#: What each dp rank keeps only a shard of, beside the optimizer state (ZeRO-1, -2, -3).
SHARDING = ("optimizer", "gradients", "parameters")


def check_grad_reduction(
    bucket_size: int | None, grad_reduce: str, grad_dtype: torch.dtype | None, grad_scale: float
) -> None:
    """Raise ValueError for a bucket size, reduction, gradient dtype or scale that cannot work."""
    if bucket_size is not None and (
        isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0
    ):
        raise ValueError(
            f"bucket_size ({bucket_size!r}) must be a positive number of elements; "
            "use None for one bucket per dtype"
        )
    if grad_reduce not in ("mean", "sum"):
        raise ValueError(f"grad_reduce ({grad_reduce!r}) must be 'mean' (average over dp) or 'sum'")
    if grad_dtype is not None and not grad_dtype.is_floating_point:
        raise ValueError(
            f"grad_dtype ({grad_dtype}) must be a floating-point dtype, e.g. torch.float32, "
            "or None for each parameter's own dtype"
        )
    if (
        isinstance(grad_scale, bool)
        or not isinstance(grad_scale, (int, float))
        or not (grad_scale > 0 and math.isfinite(grad_scale))
    ):
        raise ValueError(
            f"grad_scale ({grad_scale!r}) must be a positive finite number; use 1.0 for none"
        )


def check_replicate_group(dp_group: ProcessGroup, replicate_group: ProcessGroup | None) -> None:
    """Raise ValueError when the replicate group is not orthogonal to the shard group."""
    if replicate_group is None:
        return
    shard = dist.get_process_group_ranks(dp_group)
    replicas = dist.get_process_group_ranks(replicate_group)
    common = sorted(set(shard) & set(replicas))
    if len(common) != 1:
        raise ValueError(
            f"replicate_group (ranks {replicas}) and dp_group (ranks {shard}) must meet in "
            f"this rank alone, but share {common}; pass the HSDP groups of one layout, e.g. "
            "groups.dp_shard and groups.dp_replicate"
        )


def check_sharding(
    module: nn.Module,
    sharding: str,
    use_distributed_optimizer: bool,
    gather_units: Sequence[nn.Module] | None,
    prefetch: int,
) -> None:
    """Raise ValueError for a sharding request that cannot work."""
    if sharding not in SHARDING:
        raise ValueError(
            f"sharding ({sharding!r}) must be one of {', '.join(map(repr, SHARDING))} "
            "(ZeRO-1, -2, -3)"
        )
    if sharding != "optimizer" and not use_distributed_optimizer:
        raise ValueError(
            f"sharding={sharding!r} needs use_distributed_optimizer=True (an all-reduce keeps "
            "every gradient whole); use sharding='optimizer' for a plain all-reduce"
        )
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(
            f"prefetch ({prefetch!r}) must be a number of buckets >= 0; use 0 to gather each "
            "bucket only when it is needed"
        )
    if gather_units is None:
        return
    if sharding != "parameters":
        raise ValueError(
            f"gather_units are the modules ZeRO-3 gathers at once, but sharding is "
            f"{sharding!r}; pass sharding='parameters' or leave gather_units out"
        )
    inside = {id(m) for m in module.modules()}
    for unit in gather_units:
        if id(unit) not in inside or unit is module:
            raise ValueError(
                f"gather unit {type(unit).__name__} is not a submodule of the wrapped "
                f"{type(module).__name__}; pass modules of the wrapped module (the module "
                "itself is always the root unit)"
            )
