"""Bad input fails at construction (or load) in one sentence naming the values and the way out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_zero_optim import DistributedDataParallel, DistributedOptimizer


def _net(width: int = 4) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.Linear(width, 2)).to(rank_device())


def _ddp(module: nn.Module | None = None, **kwargs: Any) -> DistributedDataParallel:
    groups = init_process_groups(ParallelConfig())
    return DistributedDataParallel(
        _net() if module is None else module, dp_group=groups.dp, **kwargs
    )


def _stepped_adamw(params: Any) -> torch.optim.Optimizer:
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(2)
    opt.step()
    opt.param_groups[0]["params"] = list(params)
    return opt


def _saved(module: nn.Module, kind: type[torch.optim.Optimizer] = torch.optim.AdamW) -> Any:
    ddp = _ddp(module)
    return DistributedOptimizer(kind(ddp.parameters(), lr=0.1), ddp).state_dict()


def _load_into(
    module: nn.Module, state: Any, kind: type[torch.optim.Optimizer] = torch.optim.AdamW
) -> None:
    ddp = _ddp(module)
    DistributedOptimizer(kind(ddp.parameters(), lr=0.1), ddp).load_state_dict(state)


CASES: dict[str, tuple[Callable[[], object], str]] = {
    "bucket_size_zero": (
        lambda: _ddp(bucket_size=0),
        "bucket_size (0) must be a positive number of elements; use None for one bucket per dtype",
    ),
    "bucket_size_negative": (lambda: _ddp(bucket_size=-8), "bucket_size (-8) must be a positive"),
    "bucket_size_float": (lambda: _ddp(bucket_size=2.5), "bucket_size (2.5) must be a positive"),
    "grad_reduce": (
        lambda: _ddp(grad_reduce="avg"),
        "grad_reduce ('avg') must be 'mean' (average over dp) or 'sum'",
    ),
    "grad_dtype": (
        lambda: _ddp(grad_dtype=torch.int32),
        "grad_dtype (torch.int32) must be a floating-point dtype",
    ),
    "several_devices": (
        lambda: _ddp(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))),
        "the module's trainable parameters are on several devices (cpu, meta); move the module "
        "to one device before wrapping it",
    ),
    "optimizer_kind": (
        lambda: (d := _ddp(), DistributedOptimizer(torch.optim.Adagrad(d.parameters()), d)),
        "Adagrad cannot be sharded by DistributedOptimizer (its update is not known to be "
        "elementwise); use torch.optim.AdamW, Adam or SGD",
    ),
    "optimizer_stepped": (
        lambda: (d := _ddp(), DistributedOptimizer(_stepped_adamw(d.parameters()), d)),
        "the optimizer already holds state for 1 parameters; wrap it in DistributedOptimizer "
        "before its first step",
    ),
    "foreign_parameter": (
        lambda: (
            d := _ddp(),
            DistributedOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(3, 5))], lr=0.1), d),
        ),
        "the optimizer holds a parameter of shape (3, 5) that no wrapped module trains",
    ),
    "max_grad_norm": (
        lambda: (
            d := _ddp(),
            DistributedOptimizer(torch.optim.AdamW(d.parameters()), d, max_grad_norm=0.0),
        ),
        "max_grad_norm (0.0) must be positive; use None to disable clipping",
    ),
    "state_of_other_model": (
        lambda: _load_into(_net(), _saved(nn.Sequential(nn.Linear(4, 4)))),
        "the state dict is from a different model: this model's ['1.bias', '1.weight'] are "
        "missing from it",
    ),
    "state_of_other_shape": (
        lambda: _load_into(_net(4), _saved(_net(6))),
        "parameter '1.weight' has shape (2, 6) in the state dict but (2, 4) in this model",
    ),
    "state_of_other_optimizer": (
        lambda: _load_into(_net(), _saved(_net(), torch.optim.SGD), torch.optim.AdamW),
        "the state dict was saved from SGD but this optimizer is AdamW",
    ),
    "state_not_ours": (
        lambda: _load_into(_net(), {"state": {}, "param_groups": []}),
        "this is not a DistributedOptimizer state dict",
    ),
    "sharding_name": (
        lambda: _ddp(sharding="params"),
        "sharding ('params') must be one of 'optimizer', 'gradients', 'parameters' (ZeRO-1, -2, -3)",
    ),
    "sharding_all_reduce": (
        lambda: _ddp(sharding="gradients", use_distributed_optimizer=False),
        "sharding='gradients' needs use_distributed_optimizer=True (an all-reduce keeps every "
        "gradient whole); use sharding='optimizer' for a plain all-reduce",
    ),
    "prefetch": (
        lambda: _ddp(sharding="parameters", prefetch=-1),
        "prefetch (-1) must be a number of buckets >= 0",
    ),
    "gather_units_without_zero3": (
        lambda: (m := _net(), _ddp(m, sharding="gradients", gather_units=[m[0]])),
        "gather_units are the modules ZeRO-3 gathers at once, but sharding is 'gradients'; "
        "pass sharding='parameters' or leave gather_units out",
    ),
    "gather_unit_elsewhere": (
        lambda: _ddp(sharding="parameters", gather_units=[nn.Linear(2, 2)]),
        "gather unit Linear is not a submodule of the wrapped Sequential",
    ),
    "overlap_param_gather_zero3": (
        lambda: (
            d := _ddp(sharding="parameters"),
            DistributedOptimizer(torch.optim.AdamW(d.parameters()), d, overlap_param_gather=True),
        ),
        "overlap_param_gather does not apply to sharding='parameters'",
    ),
}


def _message(case: str) -> str:
    try:
        CASES[case][0]()
    except (ValueError, TypeError) as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_message(dist_pool: DistPool, case: str) -> None:
    message = dist_pool.run(_message, 1, args=(case,))[0]
    assert CASES[case][1] in message
    assert "\n" not in message


def _partial_shards(folder: str) -> str:
    groups = init_process_groups(ParallelConfig())
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_net(8), dp_group=groups.dp, bucket_size=10)
    opt = DistributedOptimizer(torch.optim.AdamW(ddp.parameters()), ddp)
    rank = dist.get_rank()
    torch.save(opt.state_dict(), f"{folder}/rank{rank}.pt")
    dist.barrier()
    other = torch.load(f"{folder}/rank{1 - rank}.pt", map_location=rank_device(), weights_only=True)
    try:
        opt.load_state_dict(other)  # another rank's shard alone
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_loading_another_ranks_shard_alone(dist_pool: DistPool, tmp_path: object) -> None:
    for message in dist_pool.run(_partial_shards, 2, args=(str(tmp_path),)):
        assert "the state dict shards cover 0 of the" in message
        assert message.endswith("pass the shard saved by every dp rank, each once")


def _overlapping_replicas() -> str:
    groups = init_process_groups(ParallelConfig())
    with pytest.raises(ValueError) as info:
        DistributedDataParallel(_net(), dp_group=groups.dp, replicate_group=groups.dp)
    return str(info.value)


def test_replicate_group_must_be_orthogonal_to_the_shard_group(dist_pool: DistPool) -> None:
    for message in dist_pool.run(_overlapping_replicas, 2):
        assert message.startswith(
            "replicate_group (ranks [0, 1]) and dp_group (ranks [0, 1]) must meet in this rank "
            "alone, but share [0, 1]; pass the HSDP groups"
        )
        assert "\n" not in message
