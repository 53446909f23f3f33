"""``--dry-run`` plans the whole job: bubble of the schedule, steps and tokens, the data source
and the warning for a large model on the built-in corpus (no process, no tensor)."""

from __future__ import annotations

import pytest

from mega_pretrain.config import load_config
from mega_pretrain.dry_run import builtin_corpus_tokens, data_lines, dry_run
from mega_pretrain.plan import Plan, plan_for
from mega_pretrain.validate import check_config


def _plan(world: int, *pairs: tuple[str, str]) -> Plan:
    config = load_config(None, list(pairs))
    return check_config(config, plan_for(config, world).model, world)


def test_the_bubble_follows_the_schedule() -> None:
    batch = [("train.micro_batch_size", "1"), ("train.global_batch_size", "8"),
             ("model.num_layers", "8")]  # fmt: skip
    assert _plan(1, *batch).bubble_fraction == 0.0
    one_f_one_b = _plan(4, ("pp", "4"), *batch)  # p 4, m 8: 3 / (8 + 3)
    assert one_f_one_b.schedule_name == "1F1B"
    assert one_f_one_b.bubble_fraction == pytest.approx(3 / 11)
    interleaved = _plan(4, ("pp", "4"), ("vpp", "2"), *batch)  # 3 / (2 * 8 + 3)
    assert interleaved.schedule_name == "interleaved 1F1B (vpp 2)"
    assert interleaved.bubble_fraction == pytest.approx(3 / 19)
    dp2 = _plan(8, ("pp", "4"), *batch)  # dp 2 halves the micro-batches: 3 / (4 + 3)
    assert dp2.microbatches == 4 and dp2.bubble_fraction == pytest.approx(3 / 7)


def test_the_dry_run_prints_the_job() -> None:
    text = dry_run(load_config(None, [
        ("pp", "2"), ("train.micro_batch_size", "2"), ("train.global_batch_size", "16"),
        ("train.steps", "1000"), ("train.seq_len", "64"), ("run.device", "cpu"),
    ]), 2)  # fmt: skip
    assert (
        "pipeline schedule: 1F1B, predicted bubble 11.1% of each step (pp 2, 8 micro-batches)"
        in text
    )
    assert "job: 1,000 steps of 1,024 tokens = 1,024,000 tokens" in text
    assert "memory per rank (estimate, busiest stage):" in text
    tokens = builtin_corpus_tokens()
    assert tokens > 1_000_000
    assert f"data: the built-in corpus (the standard library's sources), {tokens:,} tokens" in text
    assert "warning" not in text  # the tiny model is what the corpus is for


def test_a_large_model_on_the_builtin_corpus_is_warned() -> None:
    text = dry_run(load_config(None, [("model.size", "1b"), ("run.device", "cpu"),
                                      ("train.micro_batch_size", "1")]), 1)  # fmt: skip
    warning = [line for line in text.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1, text
    assert warning[0].startswith(
        f"warning: the built-in corpus is {builtin_corpus_tokens():,} tokens; a model of "
    )
    assert warning[0].endswith(" parameters will overfit it; point data.paths at a real dataset")
    config = load_config(None, [("data.paths", "/data/a,/data/b"), ("data.weights", "3,1")])
    assert data_lines(config, 10**9) == [
        "data: /data/a (weight 3), /data/b (weight 1); tokenizer byte"
    ]
