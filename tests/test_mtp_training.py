"""Multi-token prediction trains through the trainer at every layout like one process.

The GPT layout contract (tests/test_gpt_training_layouts.py, whose helpers run here) with
``mtp_num_layers = 1``: its reference is the plain process's ``model(tokens, labels).mean()``,
whose backward carries the MTP term, so 3 AdamW steps of the layouts must give the same
main losses, gradient norms (the MTP depth's and the shared embedding's gradients
included) and full weights (``mtp.0.*`` among them). Under pp the depth runs on the last
stage, which keeps a copy of the embedding whose gradient is summed with the first
stage's; under cp the labels are shifted before the zig-zag split. The reduction lengths
count the depth as one more layer (``_tolerance``). The trainer trains ``tiny`` with
``--model.mtp_num_layers 1`` from the command line, logs ``mtp_loss`` and its losses fall.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_gpt_training_layouts import _check, _world

from mega_parallel_grid.testing import DistPool

MTP: dict[str, object] = {"mtp_num_layers": 1}
#: the last layer MoE, so the depth's layer is MoE too (router losses off: the GPT contract's
#: reference weighs only the language-model loss)
MOE_MTP: dict[str, object] = {
    "mtp_num_layers": 1, "num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 64,
    "moe_layer_freq": 2, "moe_layer_pattern": "-E-E-E-E",
}  # fmt: skip

CASES = [
    ({"tp": 2, "sequence_parallel": True}, MTP, 1),
    ({"pp": 2}, MTP, 1),
    ({"pp": 2, "vpp": 2}, MTP, 1),
    ({}, MTP, 2),  # dp 2, the distributed optimizer (the trainer's default)
    ({"cp": 2}, MTP, 1),
    ({"pp": 2, "ep": 2}, MOE_MTP, 2),
]


@pytest.mark.parametrize(
    ("layout", "model", "dp"),
    CASES,
    ids=["tp2-sp", "pp2", "pp2-vpp2", "dp2-distopt", "cp2", "moe-ep2-pp2-dp2"],
)
def test_mtp_training_matches_single_process(
    dist_pool: DistPool, layout: dict[str, object], model: dict[str, object], dp: int
) -> None:
    assert _world(layout, dp) <= 4
    _check(dist_pool, layout, model, dp)


def test_trainer_trains_tiny_with_mtp_from_the_cli(tmp_path: Path) -> None:
    env = {**os.environ, "MEGA_PRETRAIN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    args = ["--model.size", "tiny", "--model.mtp_num_layers", "1", "--train.steps", "8",
            "--train.log_interval", "1", "--train.seq_len", "32", "--run.tensorboard", "false",
            "--checkpoint.save_interval", "0", "--run.name", "mtp"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "mega_pretrain", *args], cwd=tmp_path, env=env, text=True,
        capture_output=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "runs/mtp/metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all("mtp_loss" in r and "mtp_loss_1" not in r for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    assert records[-1]["mtp_loss"] < records[0]["mtp_loss"]
    assert " mtp " in done.stdout
