"""The dry-run memory estimate per ZeRO stage, and ``train.micro_batch_size 0`` reading it."""

from __future__ import annotations

import pytest

from mega_pretrain.auto_batch import resolve_micro_batch
from mega_pretrain.config import TrainerConfig, load_config
from mega_pretrain.dry_run import dry_run
from mega_pretrain.estimate import estimate
from mega_pretrain.plan import plan_for

#: the tiny GPT: vocab 257 x hidden 64 per embedding matrix
EMBED = 257 * 64


def _config(stage: str, *extra: tuple[str, str]) -> TrainerConfig:
    return load_config(None, [
        ("parallel.sharding", stage), ("train.precision", "bf16"), ("train.micro_batch_size", "1"),
        ("train.global_batch_size", "4"), ("parallel.bucket_size", "1000"), *extra,
    ])  # fmt: skip


# bytes per parameter (weights, gradients, optimizer) with bf16 weights, fp32 gradients,
# fp32 masters and both Adam moments, at dp 4: 2 + 4 + 12/4, 2 + 16/4, 18/4
PER_PARAM = {"optimizer": (2, 4, 3), "gradients": (2, 1, 3), "parameters": (0.5, 1, 3)}


@pytest.mark.parametrize("stage", list(PER_PARAM))
def test_bytes_per_parameter_follow_the_stage(stage: str) -> None:
    est = estimate(plan_for(_config(stage), 4))
    n = est.params_per_rank
    assert n == est.total_params  # tp = pp = 1: every rank holds the whole model
    weights, grads, optimizer = PER_PARAM[stage]
    assert est.weights == pytest.approx(weights * n, abs=1)
    assert est.grads == pytest.approx(grads * n, abs=1)
    assert est.optimizer == pytest.approx(optimizer * n, abs=1)


def test_alias_estimates_like_its_stage() -> None:
    a = estimate(plan_for(_config("optim_grads_params"), 4))
    assert a == estimate(plan_for(_config("parameters"), 4))


def test_in_flight_memory_of_each_stage() -> None:
    zero1, zero2, zero3 = (
        estimate(plan_for(_config(stage), 4)) for stage in ("optimizer", "gradients", "parameters")
    )
    n = zero3.params_per_rank
    assert zero1.in_flight == 0
    # 3 buckets of full fp32 gradients, each at least the embedding's (one parameter
    # larger than the 1,000-element bucket size)
    assert zero2.in_flight == 3 * EMBED * 4
    # ZeRO-3 also: the untied embedding and output layer (the root unit) and 2 of the 8
    # layers in bf16
    layer = (n - 2 * EMBED) // 8
    assert zero3.in_flight == 3 * EMBED * 4 + (2 * EMBED + 2 * layer) * 2
    assert zero3.total < zero2.total < zero1.total


def test_expert_state_shards_over_expert_dp() -> None:
    config = _config("gradients", ("model.size", "mixtral-tiny"), ("ep", "2"))
    plan = plan_for(config, 4)
    est = estimate(plan)
    dense, expert = plan.spec.params_per_rank(plan.model, plan.parallel, max(plan.rank_layers))
    # dense gradients over dp 4, the experts' over expert-dp 4 / ep 2 = 2
    assert est.grads == dense * 4 // 4 + expert * 4 // 2


def test_auto_micro_batch_fits_more_under_zero3() -> None:
    """1b at seq 2048 on 8 ranks in 36 GiB: ZeRO-1's ~7.8 GiB of state leaves room for
    micro-batches of 4, ZeRO-3's ~2.4 GiB (plus 1.1 GiB in flight) for 8."""
    picked = {}
    for stage in ("optimizer", "parameters"):
        config = load_config(None, [
            ("model.size", "1b"), ("train.seq_len", "2048"), ("train.global_batch_size", "64"),
            ("train.micro_batch_size", "0"), ("parallel.sharding", stage),
            ("run.memory_gib", "36"), ("train.precision", "bf16"),
        ])  # fmt: skip
        resolved, line = resolve_micro_batch(config, plan_for(config, 8).model, 8, None)
        assert line is not None and "micro_batch_size auto" in line
        picked[stage] = resolved.train.micro_batch_size
    assert picked == {"optimizer": 4, "parameters": 8}


def test_dry_run_names_the_stage_and_its_in_flight_memory() -> None:
    text = dry_run(_config("parameters"), 4)
    assert "  sharding    parameters (ZeRO-3, parallel.sharding)" in text
    assert "in flight" in text
    assert "in flight" not in dry_run(_config("optimizer"), 4)


@pytest.mark.parametrize("stage", list(PER_PARAM))
def test_offload_moves_masters_and_moments_to_the_host(stage: str) -> None:
    # dp 4, bf16 + AdamW: the (4 + 8)/4 bytes of masters and moments, and a 4/4 copy of their
    # fp32 gradients, leave the device for the host; weights and gradients stay
    on = estimate(plan_for(_config(stage, ("parallel.optimizer_offload", "true")), 4))
    off = estimate(plan_for(_config(stage), 4))
    n = on.params_per_rank
    assert on.optimizer == 0 and off.host == 0
    assert (on.weights, on.grads) == (off.weights, off.grads)
    assert on.host == pytest.approx(4 * n, abs=2)
    assert on.total == off.total - off.optimizer
    text = dry_run(_config(stage, ("parallel.optimizer_offload", "true")), 4)
    assert "host" in text and "parallel.optimizer_offload" in text
