"""Train a registered tiny model from the command line for a few steps; read its losses.

The "trains from the CLI and its loss falls" check every family's tests make: a fresh
``python -m mega_pretrain`` process on one CPU rank, 12 steps of 4 x 32 tokens, metrics
in JSONL, no checkpoints, evaluation or TensorBoard.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["assert_loss_falls", "run_from_cli", "train_from_cli"]

STEPS = 12


def run_from_cli(
    tmp_path: Path, config: Path, run_name: str, *extra: str
) -> tuple[list[dict[str, Any]], str]:
    """``STEPS`` steps of ``--config config`` (run ``run_name``): the logged training records
    (``metrics.jsonl``) and what the run printed."""
    env = {**os.environ, "MEGA_PRETRAIN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    args = [
        sys.executable, "-m", "mega_pretrain", "--config", str(config),
        "--train.steps", str(STEPS), "--train.warmup_steps", "2", "--train.log_interval", "1",
        "--train.seq_len", "32", "--train.micro_batch_size", "4", "--train.global_batch_size", "4",
        "--train.eval_interval", "0", "--run.tensorboard", "false",
        "--checkpoint.save_interval", "0", "--run.out_dir", str(tmp_path / "runs"), *extra,
    ]  # fmt: skip
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = (tmp_path / "runs" / run_name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"], done.stdout


def train_from_cli(tmp_path: Path, config: Path, run_name: str, *extra: str) -> list[float]:
    """The logged training losses of ``STEPS`` steps of ``--config config`` (run ``run_name``)."""
    return [r["loss"] for r in run_from_cli(tmp_path, config, run_name, *extra)[0]]


def assert_loss_falls(losses: list[float], by: float = 0.1) -> None:
    """Every step logged, and the last three steps' mean loss ``by`` below the first three's."""
    assert len(losses) == STEPS, losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - by, losses
