"""``train.micro_batch_size = 0``: the largest micro-batch whose memory estimate fits."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mega_pretrain.auto_batch import HEADROOM, resolve_micro_batch
from mega_pretrain.build import gpt_config
from mega_pretrain.cli import main
from mega_pretrain.config import TrainerConfig, load_config
from mega_pretrain.estimate import estimate
from mega_pretrain.plan import plan_for

GIB = 2**30


def _config(*pairs: tuple[str, str]) -> TrainerConfig:
    base = [("model.size", "1b-bench"), ("train.seq_len", "2048"), ("train.precision", "bf16"),
            ("train.micro_batch_size", "0"), ("train.global_batch_size", "64")]  # fmt: skip
    return load_config(None, [*base, *pairs])


def _need(config: TrainerConfig, micro: int, world_size: int) -> float:
    trial = replace(config, train=replace(config.train, micro_batch_size=micro))
    return float(estimate(plan_for(trial, world_size)).total)


def test_an_explicit_micro_batch_is_kept() -> None:
    config = _config(("train.micro_batch_size", "4"))
    assert resolve_micro_batch(config, gpt_config(config), 1, None) == (config, None)


@pytest.mark.parametrize("memory_gib", [40.0, 80.0, 139.8])
def test_auto_picks_the_largest_that_fits(memory_gib: float) -> None:
    config = _config(("run.memory_gib", str(memory_gib)))
    chosen, line = resolve_micro_batch(config, gpt_config(config), 1, None)
    micro = chosen.train.micro_batch_size
    assert line is not None and f"auto: {micro} " in line
    budget = HEADROOM * memory_gib * GIB
    assert 64 % micro == 0 and _need(config, micro, 1) <= budget
    larger = [m for m in range(micro + 1, 65) if 64 % m == 0]
    assert all(_need(config, m, 1) > budget for m in larger)  # nothing larger fits


def test_the_gpu_memory_is_the_default_budget_and_memory_gib_wins() -> None:
    config = _config()
    model = gpt_config(config)
    small, _ = resolve_micro_batch(config, model, 1, 40 * GIB)
    large, _ = resolve_micro_batch(config, model, 1, 140 * GIB)
    assert small.train.micro_batch_size < large.train.micro_batch_size
    pinned = _config(("run.memory_gib", "40"))
    assert resolve_micro_batch(pinned, model, 1, 140 * GIB)[0] == replace(
        pinned, train=replace(pinned.train, micro_batch_size=small.train.micro_batch_size)
    )


def test_dp_share_and_interleaving_limit_the_choice() -> None:
    config = _config(("run.memory_gib", "1000"), ("train.global_batch_size", "24"))
    assert resolve_micro_batch(config, gpt_config(config), 2, None)[0].train.micro_batch_size == 12
    inter = _config(("run.memory_gib", "1000"), ("train.global_batch_size", "24"),
                    ("parallel.pp", "2"), ("parallel.vpp", "2"))  # fmt: skip
    chosen, _ = resolve_micro_batch(inter, gpt_config(inter), 2, None)  # pp 2: dp 1
    assert chosen.train.micro_batch_size == 12  # 2 micro-batches: a multiple of pp


@pytest.mark.parametrize(
    ("pairs", "world", "memory", "message"),
    [
        ((), 1, None, "needs the device's memory, and there is no GPU; set run.memory_gib"),
        ((("run.memory_gib", "10"),), 1, None, "finds no micro-batch that fits: the smallest needs"),
        ((("run.memory_gib", "-5"),), 1, None, "run.memory_gib (-5.0) must be positive"),
        ((("run.memory_gib", "100"), ("train.global_batch_size", "3")), 2, None,
         "train.global_batch_size (3) is not divisible by dp (2)"),
    ],
)  # fmt: skip
def test_bad_input_is_one_sentence(
    pairs: tuple[tuple[str, str], ...], world: int, memory: int | None, message: str
) -> None:
    config = _config(*pairs)
    with pytest.raises(ValueError, match=r"^[^\n]+$") as info:
        resolve_micro_batch(config, gpt_config(config), world, memory)
    assert message in str(info.value)


def test_dry_run_says_what_it_chose(capsys: pytest.CaptureFixture[str]) -> None:
    # what it should choose, from the estimate: the largest divisor of 64 that fits
    config = _config(("run.memory_gib", "139.8"))
    budget = HEADROOM * 139.8 * GIB
    expected = max(m for m in range(1, 65) if 64 % m == 0 and _need(config, m, 1) <= budget)
    code = main(["--model.size", "1b-bench", "--train.precision", "bf16", "--train.seq_len", "2048",
                 "--train.micro_batch_size", "0", "--train.global_batch_size", "64",
                 "--run.memory_gib", "139.8", "--dry-run"])  # fmt: skip
    assert code == 0
    need = _need(config, expected, 1) / GIB
    assert f"micro_batch_size auto: {expected} (estimate {need:.1f} GiB" in capsys.readouterr().out


def test_trainer_runs_with_auto(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(
        [sys.executable, "-m", "mega_pretrain", "--train.micro_batch_size", "0",
         "--run.memory_gib", "0.05", "--train.global_batch_size", "8", "--train.steps", "2",
         "--train.seq_len", "32", "--train.log_interval", "1", "--run.out_dir", str(tmp_path)],
        cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "micro_batch_size auto:" in done.stdout and "step      2/2" in done.stdout
