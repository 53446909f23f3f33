"""Multi-token prediction trains through the trainer at every layout like one process.

The GPT layout contract (tests/test_gpt_training_layouts.py, whose helpers run here) with
``mtp_num_layers = 1`` (4 layers): its reference is the plain process's ``model(tokens, labels).mean()``,
whose backward carries the MTP term, so 3 AdamW steps of the layouts must give the same
main losses, gradient norms (the MTP depth's and the shared embedding's gradients
included) and full weights (``mtp.0.*`` among them). Under pp the depth runs on the last
stage, which keeps a copy of the embedding whose gradient is summed with the first
stage's; under cp the labels are shifted before the zig-zag split. The reduction lengths
count the depth as one more layer (``_tolerance``). A checkpoint saved at tp2·pp2 (GPT and MLA; the
depth and the embedding copy on the last stage) loads bitwise at pp 1 and at pp2·vpp2, and
the next step there equals the saved layout's to rounding. (The command line trains an MTP
model, logging ``mtp_loss``, in ``test_mla_training``'s ``deepseek-v3-tiny`` run.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_gpt_training_layouts import (
    LR,
    SEQ,
    _batches,
    _chain,
    _check,
    _full_weights,
    _micro,
    _overrides,
    _world,
)

from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_pretrain.build import build, gpt_config, parallel_config
from mega_pretrain.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from mega_pretrain.config import load_config
from mega_pretrain.step import StepRunner

MTP: dict[str, object] = {"mtp_num_layers": 1, "num_layers": 4}  # one layer per vpp stage
#: the last layer MoE, so the depth's layer is MoE too (router losses off: the GPT contract's
#: reference weighs only the language-model loss)
MOE_MTP: dict[str, object] = {
    "mtp_num_layers": 1, "num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 64,
    "moe_layer_freq": 2, "moe_layer_pattern": "-E-E-E-E",
}  # fmt: skip

#: DeepSeek-V3's pairing: multi-head latent attention under the MTP depth (each query head
#: its own key and value, so num_query_groups = heads)
MLA_MTP: dict[str, object] = {
    "mtp_num_layers": 1, "attention": "mla", "num_query_groups": 8, "q_lora_rank": 32,
    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
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


Weights = dict[str, torch.Tensor]


class _Run:
    """The trainer's model, optimizer and step runner at ``layout`` (MTP 1), on this rank."""

    def __init__(self, layout: dict[str, object], seed: int, model: dict[str, object]) -> None:
        config = load_config(None, [*_overrides(layout, model), ("train.seed", str(seed))])
        self.groups = init_process_groups(parallel_config(config))
        self.built = build(config, self.groups, rank_device())
        self.micro = _micro(layout)
        self.runner = StepRunner(
            self.built, self.groups, seq_len=SEQ, micro_batch_size=self.micro,
            hidden_size=gpt_config(config).hidden_size, dtype=torch.float32,
            device=rank_device(), sequence_parallel=False,
        )  # fmt: skip

    def step(self, step: int) -> float:
        dp, dp_rank = self.groups.size("dp"), self.groups.rank("dp")
        loss, _ = self.runner.train_step(_batches(7, step, self.micro)[dp_rank::dp], LR)
        return float(loss)


def _save(run_dir: str, model: dict[str, object]) -> tuple[Weights, float]:
    run = _Run({"tp": 2, "pp": 2}, seed=1234, model=model)
    run.step(0)
    save_checkpoint(Path(run_dir), 1, run.built, run.groups, {})
    saved = _full_weights(run.built.chunks)
    return saved, run.step(1)


def _load(
    run_dir: str, layout: dict[str, object], model: dict[str, object]
) -> tuple[Weights, float]:
    run = _Run(layout, seed=99, model=model)  # other initial weights: all from the file
    path = latest_checkpoint(Path(run_dir))
    assert path is not None
    load_checkpoint(path, run.built, run.groups)
    return _full_weights(run.built.chunks), run.step(1)


@pytest.mark.parametrize("model", [MTP, MLA_MTP], ids=["gpt-mtp", "mla-mtp"])
def test_mtp_checkpoint_reshards(
    dist_pool: DistPool, tmp_path: Path, model: dict[str, object]
) -> None:
    results = dist_pool.run(_save, 4, args=(str(tmp_path), model))
    saved: Weights = {}
    for weights, _ in results:  # each stage its own layers; the last also mtp.0.*
        saved.update(weights)
    assert any(name.startswith("mtp.0.") for name in saved)
    forward, _ = _chain(model)
    for layout, world in (({}, 1), ({"pp": 2, "vpp": 2}, 2)):
        loaded: Weights = {}
        for weights, loss in dist_pool.run(_load, world, args=(str(tmp_path), layout, model)):
            loaded.update(weights)
            assert_close_to_reference(loss, results[0][1], reduction_length=forward, name="loss")
        assert loaded.keys() == saved.keys()
        for name, value in loaded.items():
            assert torch.equal(value, saved[name]), f"{name} differs after loading at {layout}"
