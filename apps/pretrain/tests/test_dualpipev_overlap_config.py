"""``parallel.dualpipev_overlap``: checked at config time, told by the dry run, set on the chunks."""

from __future__ import annotations

import pytest

from mega_pretrain.config import load_config
from mega_pretrain.dry_run import dry_run
from mega_pretrain.plan import plan_for
from mega_pretrain.validate import check_config

V = [("pp", "2"), ("vpp", "2"), ("train.micro_batch_size", "1"), ("run.device", "cpu")]


def _dualpipev(*extra: tuple[str, str]) -> list[tuple[str, str]]:
    return [*V, ("parallel.pp_schedule", "dualpipev"), *extra]


def test_the_overlap_is_on_by_default_and_said_so() -> None:
    text = dry_run(load_config(None, _dualpipev()), 2)
    assert "dualpipev pairs: overlapped, one micro-batch's forward interleaved" in text


def test_switched_off_the_dry_run_says_the_pairs_run_apart() -> None:
    text = dry_run(load_config(None, _dualpipev(("parallel.dualpipev_overlap", "false"))), 2)
    assert "dualpipev pairs: run apart" in text and "dualpipev_overlap false" in text


def test_a_family_without_the_hook_runs_the_pairs_apart() -> None:
    text = dry_run(load_config(None, _dualpipev(("model.size", "hybrid-tiny"))), 2)
    assert "dualpipev pairs: run apart" in text and "hybrid chunks offer no" in text


def test_other_schedules_say_nothing_of_pairs() -> None:
    assert "dualpipev pairs" not in dry_run(
        load_config(None, [*V, ("parallel.pp_schedule", "zbv")]), 2
    )


def test_the_switch_off_under_another_schedule_is_one_sentence() -> None:
    config = load_config(
        None, [*V, ("parallel.pp_schedule", "zbv"), ("parallel.dualpipev_overlap", "false")]
    )
    with pytest.raises(ValueError) as info:
        check_config(config, plan_for(config, 2).model, 2)
    message = str(info.value)
    assert message == (
        "parallel.dualpipev_overlap false only applies to pp_schedule 'dualpipev', but the "
        "schedule is 'zbv'; drop the setting or set --parallel.pp_schedule dualpipev"
    )
