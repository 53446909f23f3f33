"""``parallel.sharding``: its values and aliases, and every refused combination, in one sentence."""

from __future__ import annotations

import pytest

from mega_pretrain.config import load_config
from mega_pretrain.plan import plan_for
from mega_pretrain.validate import check_config


def _check(*overrides: tuple[str, str], world: int = 2) -> None:
    config = load_config(None, list(overrides))
    check_config(config, plan_for(config, world).model, world)


@pytest.mark.parametrize(
    ("value", "stage"),
    [
        ("optimizer", "optimizer"), ("gradients", "gradients"), ("parameters", "parameters"),
        ("optim", "optimizer"), ("optim_grads", "gradients"),
        ("optim_grads_params", "parameters"),
    ],
)  # fmt: skip
def test_sharding_and_megatron_aliases_resolve(value: str, stage: str) -> None:
    config = load_config(None, [("parallel.sharding", value)])
    assert config.parallel.zero_stage == stage
    _check(("parallel.sharding", value))


def test_sharding_defaults_to_zero1() -> None:
    assert load_config(None, []).parallel.zero_stage == "optimizer"


def test_unknown_sharding_names_the_choices() -> None:
    with pytest.raises(
        ValueError, match=r"parallel.sharding \('full'\) must be one of 'optimizer'"
    ):
        load_config(None, [("parallel.sharding", "full")])


REFUSED = [
    (
        [("parallel.optimizer_offload", "true"), ("parallel.distributed_optimizer", "false")],
        r"parallel.optimizer_offload moves the distributed optimizer's fp32 shards to the host, "
        r"but parallel.distributed_optimizer is false",
    ),
    (
        [("parallel.sharding", "gradients"), ("parallel.distributed_optimizer", "false")],
        r"parallel.sharding 'gradients' shards the gradients over dp, which needs "
        r"parallel.distributed_optimizer true",
    ),
    (
        [("parallel.sharding", "optim_grads_params"), ("parallel.distributed_optimizer", "false")],
        r"parallel.sharding 'optim_grads_params' shards the gradients",
    ),
    (
        [("parallel.sharding", "parameters"), ("parallel.overlap_param_gather", "true")],
        r"parallel.overlap_param_gather does not apply to parallel.sharding 'parameters'",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), REFUSED, ids=lambda v: str(v)[:40])
def test_impossible_combinations_fail_at_config_time(
    overrides: list[tuple[str, str]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _check(*overrides)


def test_moe_hsdp_refuses_expert_shards_straddling_replicas() -> None:
    """ep*etp 2 and a replica of 3 ranks: neither divides the other."""
    message = (
        r"^parallel.dp_shard \(3\) with an MoE model needs ep\*etp \(2\*1 = 2\) and "
        r"tp\*cp\*dp_shard \(1\*1\*3 = 3\) to divide one another, so that each expert "
        r"shard group lies inside one replica; choose a dp_shard for which they do$"
    )
    with pytest.raises(ValueError, match=message):
        _check(
            ("parallel.dp_shard", "3"),
            ("model.size", "mixtral-tiny"),
            ("ep", "2"),
            ("train.micro_batch_size", "2"),
            ("train.global_batch_size", "12"),
            world=6,
        )


@pytest.mark.parametrize(
    "overrides",
    [
        [("parallel.sharding", "gradients"), ("model.size", "mixtral-tiny")],  # ZeRO-2 MoE
        [("parallel.sharding", "parameters"), ("model.size", "mixtral-tiny"), ("ep", "2")],
        [("parallel.sharding", "gradients"), ("train.compile", "true")],
        [("parallel.sharding", "parameters"), ("train.compile", "true")],
        [
            ("parallel.sharding", "parameters"),
            ("train.compile", "true"),
            ("train.recompute", "full"),
        ],
        [("parallel.sharding", "parameters"), ("pp", "2"), ("model.tie_embeddings", "true")],
        [("parallel.sharding", "parameters"), ("cp", "2"), ("train.seq_len", "64")],
    ],
    ids=[
        "zero2-moe",
        "zero3-moe-ep2",
        "zero2-compile",
        "zero3-compile",
        "zero3-compile-full",
        "zero3-tied-pp2",
        "zero3-cp2",
    ],
)
def test_runnable_combinations_pass(overrides: list[tuple[str, str]]) -> None:
    _check(*overrides, ("train.micro_batch_size", "2"), world=4)
