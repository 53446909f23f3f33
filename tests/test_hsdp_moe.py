"""Contract: HSDP (``parallel.dp_shard``) for an MoE model through the trainer equals one process.

``test_moe_training``'s check (Mixtral-style, 2 layers, hidden 32, 4 experts, top-2; 3 AdamW
steps clipped below every step's norm; losses, gradient norms, router statistics and the
full weights against one plain process, with its rounding bounds) at dp 4 = 2 shards x 2
replicas. The dense weights shard over dp_shard and all-reduce across dp_replicate; the
expert weights shard over edp_shard (the part of the expert data-parallel group inside one
replica) and all-reduce across edp_replicate. The gradient norm must count each shard once:
counting the replicas' copies of the expert shards too would put the experts' squares in
twice. Each worker also checks that the expert wrapper got those groups, and at ZeRO-2/3
that only the shards stay allocated after the last step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import test_moe_training as moe
import test_zero_trainer as zero_trainer
import torch
import torch.distributed as dist

from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_pretrain.build import Built, build, gpt_config, parallel_config
from mega_pretrain.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from mega_pretrain.config import load_config
from mega_pretrain.estimate import estimate
from mega_pretrain.plan import plan_for
from mega_pretrain.step import StepRunner
from mega_pretrain.validate import check_config
from mega_zero_optim.sharded_buffer import ShardedBuffer

# (parallel settings, dp): ep 2 over dp 4 = 2 x 2 puts each expert once in a replica
# (edp_shard 1, edp_replicate 2); ep 1 shards the experts over 2 ranks of a replica, and so
# does ep 2 beside tp 2 with etp 1 (a replica of 4 ranks holds every expert twice).
CASES = [
    ({"ep": 2, "dp_shard": 2, "sharding": "optimizer"}, 4),
    ({"ep": 2, "dp_shard": 2, "sharding": "gradients"}, 4),
    ({"ep": 2, "dp_shard": 2, "sharding": "parameters"}, 4),
    ({"ep": 1, "dp_shard": 2, "sharding": "gradients"}, 4),
    ({"ep": 1, "dp_shard": 2, "sharding": "parameters"}, 4),
    ({"tp": 2, "etp": 1, "ep": 2, "dp_shard": 2, "sharding": "gradients"}, 4),  # experts 2 x 2
]


@pytest.mark.parametrize(
    ("layout", "dp"),
    CASES,
    ids=["-".join(f"{k}{v}" for k, v in lay.items()) + f"-dp{dp}" for lay, dp in CASES],
)
def test_moe_hsdp_trains_like_one_process(
    dist_pool: DistPool, layout: dict[str, object], dp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(moe, "_parallel", _hsdp_parallel)  # the workers run it by name
    moe._check(dist_pool, layout, moe.MIXTRAL, dp)


def _hsdp_parallel(layout: dict[str, object], *args: Any) -> Any:
    """test_zero_trainer's MoE run (full weights read inside ``gathered_parameters``), then
    a look at the expert wrapper's groups and shards."""
    built: list[Built] = []

    def recording(*a: Any, **k: Any) -> Built:
        built.append(build(*a, **k))
        return built[-1]

    zero_trainer.build = recording
    try:
        result = zero_trainer._moe_parallel(layout, *args)
    finally:
        zero_trainer.build = build
    _check_expert_wrapper(built[-1], layout)
    return result


def _check_expert_wrapper(built: Built, layout: dict[str, object]) -> None:
    ddp = built.expert_ddp
    assert ddp is not None
    tp, ep, dp_shard = (int(str(layout.get(k, 1))) for k in ("tp", "ep", "dp_shard"))
    etp = int(str(layout.get("etp", tp)))
    replicas = dist.get_world_size() // (tp * dp_shard)  # no pp or cp here
    # experts: the tp*dp_shard ranks of a replica, ep*etp of them per copy of every expert
    assert (ddp.dp_size, ddp.replicate_size) == (tp * dp_shard // (ep * etp), replicas)
    assert ddp.replicate_group is not None
    mine = set(dist.get_process_group_ranks(ddp.dp_group))
    across = set(dist.get_process_group_ranks(ddp.replicate_group))
    assert mine & across == {dist.get_rank()}
    assert (built.ddp.dp_size, built.ddp.replicate_size) == (dp_shard, replicas)
    assert ddp.sharding == layout["sharding"]
    for buffer in ddp.param_and_grad_buffers:  # between steps only the shards are allocated
        if ddp.sharding != "optimizer":
            assert isinstance(buffer, ShardedBuffer)
            assert buffer.grad_bytes == buffer.grad_shard_data.numel() * 4
            assert buffer.grad_shard_data.numel() * ddp.dp_size >= buffer.numel
            if ddp.sharding == "parameters":
                assert buffer.param_bytes == buffer.numel // ddp.dp_size * 4


@pytest.mark.parametrize(
    ("overrides", "world"),
    [
        ([("ep", "2"), ("parallel.dp_shard", "2")], 4),  # a replica holds each expert once
        ([("ep", "4"), ("parallel.dp_shard", "2")], 4),  # a replica of 2 holds half of them
        ([("ep", "2"), ("tp", "2"), ("etp", "1"), ("parallel.dp_shard", "2")], 8),
    ],
    ids=["ep2-dp4", "ep4-dp4", "ep2-tp2-etp1-dp4"],
)
def test_moe_hsdp_configs_pass_the_checks(overrides: list[tuple[str, str]], world: int) -> None:
    config = load_config(
        None, [("model.size", "mixtral-tiny"), ("train.micro_batch_size", "2"), *overrides]
    )
    check_config(config, plan_for(config, world).model, world)


@pytest.mark.parametrize("ep", ["1", "2"])
@pytest.mark.parametrize("stage", ["optimizer", "gradients", "parameters"])
def test_moe_hsdp_estimate_shards_like_one_replica(ep: str, stage: str) -> None:
    """dp 4 = 2 x 2 keeps per rank what dp 2 without HSDP keeps: the experts shard over
    edp_shard (2 at ep 1, 1 at ep 2), not over all of edp."""

    def bytes_at(world: int, *extra: tuple[str, str]) -> tuple[int, int, int]:
        config = load_config(None, [
            ("model.size", "mixtral-tiny"), ("train.micro_batch_size", "2"), ("ep", ep),
            ("parallel.sharding", stage), ("train.precision", "bf16"), *extra,
        ])  # fmt: skip
        est = estimate(plan_for(config, world))
        return est.weights, est.grads, est.optimizer

    assert bytes_at(4, ("parallel.dp_shard", "2")) == bytes_at(2)


def _trained(layout: dict[str, object], seed: int) -> tuple[Built, Any, StepRunner]:
    config = load_config(None, [*moe._overrides(layout, moe.MIXTRAL), ("train.seed", str(seed))])
    groups = init_process_groups(parallel_config(config))
    built = build(config, groups, rank_device())
    runner = StepRunner(
        built, groups, seq_len=moe.SEQ, micro_batch_size=moe.MICRO,
        hidden_size=gpt_config(config).hidden_size, dtype=torch.float32, device=rank_device(),
        sequence_parallel=False,
    )  # fmt: skip
    return built, groups, runner


def _step(built: Built, groups: Any, runner: StepRunner, step: int) -> float:
    dp, dp_rank = groups.size("dp"), groups.rank("dp")
    loss, _ = runner.train_step(moe._batches(7, step, moe.MICRO)[dp_rank::dp], moe.LR)
    return float(loss)


def _weights(built: Built) -> dict[str, torch.Tensor]:
    with built.gathered_parameters():
        return moe._full_weights(built.chunks)


Saved = tuple[dict[str, torch.Tensor], float, dict[str, torch.Tensor]]  # weights, loss, after


def _save(run_dir: str, layout: dict[str, object]) -> Saved:
    built, groups, runner = _trained(layout, seed=1234)
    for step in range(2):
        _step(built, groups, runner, step)
    saved = _weights(built)
    save_checkpoint(Path(run_dir), 2, built, groups, {"step": 2, "consumed_samples": 16})
    loss = _step(built, groups, runner, 2)
    return saved, loss, _weights(built)


def _load(run_dir: str) -> Saved:
    built, groups, runner = _trained({}, seed=99)  # other initial weights, one process
    path = latest_checkpoint(Path(run_dir))
    assert path is not None
    load_checkpoint(path, built, groups)
    loaded = _weights(built)
    loss = _step(built, groups, runner, 2)
    return loaded, loss, _weights(built)


@pytest.mark.parametrize(
    "layout",
    [
        {"ep": 2, "dp_shard": 2, "sharding": "parameters"},
        {"ep": 1, "dp_shard": 2, "sharding": "gradients"},
    ],
    ids=["zero3-ep2", "zero2-ep1"],
)
def test_moe_hsdp_checkpoint_loads_in_one_process(
    dist_pool: DistPool, tmp_path: Path, layout: dict[str, object]
) -> None:
    """Saved at dp 4 = 2 x 2, loaded by one process: the full weights bitwise, the next
    step's loss and weights (which read the loaded Adam state) to the rounding bounds of
    one step (the next step reorders its sums)."""
    saved, loss, after = dist_pool.run(_save, 4, args=(str(tmp_path), layout), timeout=300)[0]
    loaded, next_loss, next_weights = dist_pool.run(_load, 1, args=(str(tmp_path),), timeout=300)[0]
    assert loaded.keys() == saved.keys()
    for name, value in loaded.items():
        assert torch.equal(value, saved[name]), f"{name} differs after loading"
    forward, grad = moe._chain(moe.MIXTRAL)
    assert_close_to_reference(
        torch.tensor(next_loss), torch.tensor(loss), reduction_length=forward, name="loss"
    )
    for name, value in next_weights.items():
        assert_close_to_reference(value, after[name], reduction_length=grad, name=name)
