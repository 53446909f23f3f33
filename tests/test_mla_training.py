"""A GPT with multi-head latent attention trains through the trainer at tp + SP, pp + vpp,
dp with the distributed optimizer, and ep · etp 1 with tp 2 on an MoE, like one process.

The checks are the GPT and MoE layout contracts' own (``test_gpt_training_layouts._check``
and ``test_moe_training._check``: 3 AdamW steps; every step's loss and gradient norm and the
full weights after the last step equal the plain single-process run's within the rounding
bound of the model's chain of sums), run on MLA models: the layout suite's tiny GPT cut to
4 layers with a 32-wide query latent, a 16-wide key/value latent and qk heads (8 + 4 rope)
wider than the value heads (6); the MoE suite's DeepSeek-style model with the same MLA.
Also a standard-attention model whose head width (kv_channels 16) is not hidden/heads at
tp 2. And the registered ``deepseek-v3-tiny`` (MLA, DeepSeek routing, one MTP module) trains from
the command line with ``configs/deepseek-v3-tiny.toml``: its loss and its MTP loss fall,
and the MTP loss is logged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import test_moe_training as moe
from _cli_training import assert_loss_falls, run_from_cli
from test_gpt_training_layouts import _check

from mega_parallel_grid.testing import DistPool

MLA: dict[str, Any] = {
    "attention": "mla", "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4, "v_head_dim": 6,
}  # fmt: skip
DENSE = {**MLA, "num_layers": 4, "num_query_groups": 8}  # tiny: hidden 64, 8 heads


@pytest.mark.parametrize(
    ("layout", "model", "dp"),
    [
        ({"tp": 2, "sequence_parallel": True}, DENSE, 1),
        ({"pp": 2, "vpp": 2}, DENSE, 1),
        ({}, DENSE, 2),
        ({"tp": 2, "pp": 2, "sequence_parallel": True}, {**DENSE, "mtp_num_layers": 1}, 1),
    ],
    ids=["tp2-sp", "pp2-vpp2", "dp2-distributed-optimizer", "mtp1-tp2-pp2-sp"],
)
def test_mla_training_matches_single_process(
    dist_pool: DistPool, layout: dict[str, object], model: dict[str, object], dp: int
) -> None:
    _check(dist_pool, layout, model, dp)


def test_explicit_head_width_trains_at_tp2_like_single_process(dist_pool: DistPool) -> None:
    # kv_channels 16: 8 heads of 16 on the 64-wide stream (Qwen3-0.6B's head_dim != hidden/heads)
    _check(dist_pool, {"tp": 2}, {"num_layers": 4, "kv_channels": 16}, 1)


def test_mla_moe_training_at_ep2_etp1_tp2_matches_single_process(dist_pool: DistPool) -> None:
    model = {**moe.DEEPSEEK, **MLA, "q_lora_rank": 16, "num_query_groups": 4}  # hidden 32, 4 heads
    layout = {"ep": 2, "tp": 2, "etp": 1, "sequence_parallel": True}
    moe._check(dist_pool, layout, model, 2)


def test_deepseek_v3_tiny_trains_from_the_command_line(tmp_path: Path) -> None:
    config = Path(__file__).parents[1] / "configs" / "deepseek-v3-tiny.toml"
    records, printed = run_from_cli(tmp_path, config, "deepseek-v3-tiny")
    assert_loss_falls([r["loss"] for r in records])
    # its one MTP module's loss: logged and on every log line (one depth: no per-depth key)
    assert all("mtp_loss" in r and "mtp_loss_1" not in r for r in records), records[0]
    assert_loss_falls([r["mtp_loss"] for r in records])
    assert " mtp " in printed
