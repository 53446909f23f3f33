"""The per-step time breakdown at log intervals: data, forward-backward, optimizer, checkpoint.

Each logged train record holds ``data_ms``, ``fwd_bwd_ms``, ``optim_ms`` and ``ckpt_ms`` (ms
per step over the interval); they are parts of the interval, so their sum is at most
``step_ms``; an interval that held a save shows it on the log line.
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest
import torch
from rich.console import Console

from mega_parallel_grid.testing import DistPool
from mega_pretrain.config import load_config
from mega_pretrain.phase_timer import PHASES, PhaseTimer, breakdown_text
from mega_pretrain.train import train

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError:  # an image without tensorboard: the trainer writes JSONL only
    EventAccumulator = None

KEYS = [f"{name}_ms" for name in PHASES]


def test_the_timer_sums_each_phase_per_interval_and_starts_over() -> None:
    timer = PhaseTimer(torch.device("cpu"), sync=True)  # sync: nothing to wait for on CPU
    for _ in range(2):
        with timer.phase("fwd_bwd"):
            torch.ones(64, 64) @ torch.ones(64, 64)
    first = timer.take(2)
    assert sorted(first) == sorted(KEYS)
    assert first["fwd_bwd_ms"] > 0.0 and first["data_ms"] == first["ckpt_ms"] == 0.0
    assert timer.take(1) == dict.fromkeys(KEYS, 0.0)  # a new interval
    with pytest.raises(ValueError, match="unknown phase 'forward'; the phases are data, "):
        with timer.phase("forward"):
            pass


def test_the_log_text_shows_the_checkpoint_only_when_it_cost_something() -> None:
    record = {"data_ms": 0.44, "fwd_bwd_ms": 12.06, "optim_ms": 3.0, "ckpt_ms": 0.01}
    assert breakdown_text(record) == "data 0.4 fb 12.1 opt 3.0 ms"
    record["ckpt_ms"] = 8.2
    assert breakdown_text(record) == "data 0.4 fb 12.1 opt 3.0 ckpt 8.2 ms"


def _train(out_dir: str, extra: list[tuple[str, str]]) -> str:
    os.environ["MEGA_PRETRAIN_CACHE"] = str(Path(out_dir) / "cache")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    settings = [
        ("train.steps", "6"), ("train.log_interval", "2"), ("train.seq_len", "32"),
        ("train.micro_batch_size", "2"), ("train.global_batch_size", "4"),
        ("train.eval_interval", "0"), ("run.tensorboard", "true"), ("model.num_layers", "2"),
        ("checkpoint.save_interval", "2"), ("run.out_dir", out_dir), ("run.name", "timed"),
    ]  # fmt: skip
    buffer = io.StringIO()
    train(load_config(None, [*settings, *extra]), console=Console(file=buffer, soft_wrap=True))
    return buffer.getvalue()


@pytest.mark.parametrize("extra", [[], [("train.timing_sync", "true")]], ids=["host", "sync"])
def test_the_trainer_logs_the_breakdown(
    dist_pool: DistPool, tmp_path: Path, extra: list[tuple[str, str]]
) -> None:
    printed = dist_pool.run(_train, 1, args=(str(tmp_path), extra))[0]
    lines = (tmp_path / "timed/metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    assert [r["step"] for r in records] == [2, 4, 6]
    for r in records:
        assert all(r[key] >= 0.0 for key in KEYS), r
        assert r["fwd_bwd_ms"] > 0.0 and r["optim_ms"] > 0.0, r
        assert sum(r[key] for key in KEYS) <= r["step_ms"] * (1 + 1e-9) + 1e-6, r
    # the saves at steps 2 and 4 fall in the intervals that end at steps 4 and 6
    assert records[1]["ckpt_ms"] > records[0]["ckpt_ms"], records
    steps = [line for line in printed.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, printed
    pattern = r"data \d+\.\d fb \d+\.\d opt \d+\.\d( ckpt \d+\.\d)? ms  eta"
    assert all(re.search(pattern, line) for line in steps), printed
    assert " ckpt " in steps[1] and " ckpt " in steps[2], printed
    if EventAccumulator is None:
        return
    events = EventAccumulator(str(tmp_path / "timed/tensorboard"))
    events.Reload()
    for key in KEYS:  # the same numbers in TensorBoard (W&B is fed the same record)
        logged = [(e.step, e.value) for e in events.Scalars(f"train/{key}")]
        assert [step for step, _ in logged] == [2, 4, 6]
        for (_, value), r in zip(logged, records, strict=True):
            assert value == pytest.approx(r[key], rel=1e-6, abs=1e-6)
