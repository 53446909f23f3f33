"""The trainer's command line on a tiny registered model, for the HF family tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def train_from_cli(config: Path, tmp_path: Path, *, steps: int) -> list[float]:
    """Train ``config`` for ``steps`` steps in a subprocess (one CPU rank); its train losses."""
    env = {**os.environ, "MEGA_PRETRAIN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    runs = tmp_path / "runs"
    args = [
        sys.executable, "-m", "mega_pretrain", "--config", str(config),
        "--train.steps", str(steps), "--train.warmup_steps", "2", "--train.log_interval", "1",
        "--train.seq_len", "32", "--train.micro_batch_size", "4", "--train.global_batch_size", "4",
        "--train.eval_interval", "0", "--run.tensorboard", "false",
        "--checkpoint.save_interval", "0", "--run.out_dir", str(runs),
    ]  # fmt: skip
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (run_dir,) = [p for p in runs.iterdir() if p.is_dir()]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]
