"""The resolved plan: dp, micro-batches, tokens per step, local sequence and stage split,
computed once from the config and the world size, with no process."""

from __future__ import annotations

import pytest

from mega_pretrain.config import load_config
from mega_pretrain.dry_run import dry_run
from mega_pretrain.plan import plan_for
from mega_pretrain.validate import check_config


def test_the_plan_derives_every_count_once() -> None:
    config = load_config(None, [
        ("pp", "2"), ("vpp", "2"), ("cp", "2"), ("tp", "2"), ("ep", "1"),
        ("parallel.pp_layers", "3,1,2,2"), ("train.seq_len", "64"),
        ("train.micro_batch_size", "2"), ("train.global_batch_size", "16"),
    ])  # fmt: skip
    plan = check_config(config, plan_for(config, 16).model, 16)
    assert plan.dp == 2 and plan.world_size == 16
    assert plan.microbatches == 4  # 16 / (2 * 2)
    assert plan.tokens_per_step == 16 * 64
    assert plan.local_seq_len == 32
    assert plan.stage_layers == (3, 1, 2, 2)
    assert plan.rank_layers == (5, 3)  # pp rank 0: virtual stages 0 and 2
    assert plan.parallel == config.parallel.parallel_config()
    assert plan.parallel.expert_tp == 2  # etp defaults to tp, in one place
    assert plan.spec.name == "gpt"


def test_the_family_of_the_plan_follows_the_size() -> None:
    plan = plan_for(load_config(None, [("model.size", "hybrid-tiny")]), 1)
    assert plan.spec.name == "hybrid"
    assert plan.flops_per_token() == plan.spec.flops_per_token(plan.model, 128)


def test_an_uneven_split_is_refused_in_the_plan() -> None:
    config = load_config(None, [("pp", "2"), ("parallel.pp_layers", "3,4")])
    with pytest.raises(ValueError, match=r"parallel.pp_layers \[3, 4\] must give 2 positive"):
        plan_for(config, 2)


def test_dry_run_prints_the_plan() -> None:
    text = dry_run(load_config(None, [("model.size", "hybrid-tiny"), ("run.device", "cpu")]), 1)
    assert "model family: hybrid" in text
    assert "stage layers (per virtual stage): [8]" in text
    assert "batch: 2 micro-batch(es) of 8 per dp rank per step, 2048 tokens per step" in text
