"""Distributed checkpoints: exact round trips, resharding across layouts, crash safety, errors.

The model is the contract tests' tiny GPT cut to 4 layers (vocab 257, not divisible by tp,
so the padded vocabulary rows are exercised). Resharding copies values, so weights loaded
at another layout equal the saved ones bitwise; the step after loading reorders float sums
at the new layout, so it is compared with the original layout's next step at the contract
tolerance: ``assert_close_to_reference`` with the reduction length of one step of this model
(mega_parallel_grid.testing.tolerance has the reasoning; Adam eps 1e-5 as in
tests/test_gpt_training_layouts.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mega_models import GPTModel
from mega_parallel_grid import ProcessGroups, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_pretrain.build import Built, build, gpt_config, parallel_config
from mega_pretrain.checkpoint import (
    CheckpointError,
    describe_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from mega_pretrain.ckpt import save as save_module
from mega_pretrain.config import TrainerConfig, config_to_dict, load_config
from mega_pretrain.step import StepRunner
from mega_tp_layers import gather_full, shard_spec

SEQ, MICRO, GLOBAL, LR, EPS = 16, 2, 8, 1e-3, 1e-5
MODEL: dict[str, object] = {"num_layers": 4}
#: one step's chain of sums (tiny GPT: hidden 64, ffn 128, vocab 257, 4 layers; seq 16 and
#: GLOBAL * SEQ tokens summed into a weight gradient), as models' tests count it
STEP_N = 2 * (4 * (4 * 64 + 128 + SEQ) + 64 + 257) + GLOBAL * SEQ
Weights = dict[str, torch.Tensor]


def _config(
    layout: dict[str, object], model: dict[str, object], seed: int, micro: int
) -> TrainerConfig:
    pairs: dict[str, object] = {
        "train.seq_len": SEQ, "train.micro_batch_size": micro, "train.global_batch_size": GLOBAL,
        "train.lr": LR, "train.min_lr": LR, "train.warmup_steps": 0, "train.decay": "constant",
        "train.clip_grad": 1.0, "train.eps": EPS, "train.seed": seed, "parallel.bucket_size": 1000,
    }  # fmt: skip
    pairs.update({f"parallel.{k}": v for k, v in layout.items()})
    pairs.update({f"model.{k}": v for k, v in model.items()})
    return load_config(None, [(k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in pairs.items()])  # fmt: skip


class _Run:
    """One layout's model, optimizer and step runner on this rank."""

    def __init__(
        self,
        layout: dict[str, object],
        model: dict[str, object],
        seed: int = 1234,
        micro: int = MICRO,
    ):
        self.micro = micro
        self.config = _config(layout, model, seed, micro)
        self.groups: ProcessGroups = init_process_groups(parallel_config(self.config))
        self.built: Built = build(self.config, self.groups, rank_device())
        self.gpt = gpt_config(self.config)
        self.runner = StepRunner(
            self.built, self.groups, seq_len=SEQ, micro_batch_size=micro,
            hidden_size=self.gpt.hidden_size, dtype=torch.float32, device=rank_device(),
            sequence_parallel=False,
        )  # fmt: skip

    def step(self, step: int) -> float:
        """Train on the global batch of ``step`` (the same samples at every layout)."""
        gen = torch.Generator().manual_seed(7000 + step)
        tokens = torch.randint(0, 257, (GLOBAL, SEQ + 1), generator=gen)
        m = self.micro
        batches = [(tokens[i : i + m, :-1], tokens[i : i + m, 1:]) for i in range(0, GLOBAL, m)]
        dp, dp_rank = self.groups.size("dp"), self.groups.rank("dp")
        loss, _ = self.runner.train_step(batches[dp_rank::dp], LR)
        return float(loss)

    def full_weights(self) -> Weights:
        """This stage's full (unpadded) weights, gathered over tp."""
        return _full_weights(self.built.chunks, self.groups.tp, self.gpt.vocab_size)

    def state(self, **extra: Any) -> dict[str, Any]:
        return {"config": config_to_dict(self.config), **extra}


def _full_weights(chunks: list[GPTModel], tp_group: dist.ProcessGroup, vocab: int) -> Weights:
    out = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            t = p.detach()
            spec = shard_spec(p)
            if spec is not None and spec.dim is not None and spec.num_shards > 1:
                t = gather_full(t, spec, tp_group)
            if name.startswith(("embedding.word", "output")):
                t = t[:vocab]
            out[name] = t.float().cpu().clone()
    return out


def _merge(parts: list[Weights]) -> Weights:
    merged: Weights = {}
    for part in parts:  # each pipeline stage returns its own layers
        for name, value in part.items():
            if name in merged:  # a tied copy, or another tp/dp rank: must agree exactly
                assert torch.equal(merged[name], value), name
            merged[name] = value
    return merged


# 1. same layout --------------------------------------------------------------------------


def _round_trip(run_dir: str) -> None:
    layout = {"tp": 2}
    a = _Run(layout, MODEL)
    for step in range(2):
        a.step(step)
    path = save_checkpoint(Path(run_dir), 2, a.built, a.groups, a.state(consumed_samples=16))
    cpu_rng, tracker = torch.get_rng_state(), a.built.rng.state_dict()
    next_loss = a.step(2)
    torch.manual_seed(99)
    b = _Run(layout, MODEL, seed=99)  # other initial weights and RNG streams
    state = load_checkpoint(path, b.built, b.groups)
    assert state == json.loads(json.dumps(a.state(consumed_samples=16, rng_restored=True)))
    assert torch.equal(torch.get_rng_state(), cpu_rng)
    assert all(torch.equal(v, b.built.rng.state_dict()[k]) for k, v in tracker.items())
    assert b.built.optimizer.num_steps == 2
    assert b.step(2) == next_loss
    for pa, pb in zip(a.built.ddp.parameters(), b.built.ddp.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_same_layout_round_trip_is_exact(dist_pool: DistPool, tmp_path: Path) -> None:
    dist_pool.run(_round_trip, 4, args=(str(tmp_path),))


# 2. resharding ---------------------------------------------------------------------------

TIED = {**MODEL, "tie_embeddings": True}


def _save_and_step(
    run_dir: str, layout: dict[str, object], micro: int
) -> tuple[Weights, float, Weights]:
    """Train 2 steps at ``layout``, save, then run step 2: saved weights, its loss, weights after."""
    a = _Run(layout, TIED, micro=micro)
    for step in range(2):
        a.step(step)
    save_checkpoint(Path(run_dir), 2, a.built, a.groups, a.state())
    saved = a.full_weights()
    loss = a.step(2)
    return saved, loss, a.full_weights()


def _load_and_step(
    run_dir: str, layout: dict[str, object], micro: int
) -> tuple[Weights, float, Weights, bool]:
    b = _Run(layout, TIED, seed=99, micro=micro)
    path = latest_checkpoint(Path(run_dir))
    assert path is not None
    state = load_checkpoint(path, b.built, b.groups)
    loaded = b.full_weights()
    return loaded, b.step(2), b.full_weights(), state["rng_restored"]


def _check_resharding(
    dist_pool: DistPool,
    run_dir: Path,
    saved_at: dict[str, object],
    resume_at: list[tuple[dict[str, object], int]],
    micro: int = MICRO,
) -> None:
    """Save at ``saved_at`` on 8 ranks; each (layout, world) of ``resume_at`` loads and steps."""
    results = dist_pool.run(_save_and_step, 8, args=(str(run_dir), saved_at, micro))
    saved = _merge([r[0] for r in results])
    after = _merge([r[2] for r in results])
    loss = results[0][1]
    assert {r[1] for r in results} == {loss}
    for layout, world in resume_at:
        out = dist_pool.run(_load_and_step, world, args=(str(run_dir), layout, micro))
        loaded = _merge([r[0] for r in out])
        assert loaded.keys() == saved.keys()
        for name, value in loaded.items():
            assert torch.equal(value, saved[name]), f"{name} differs after loading at {layout}"
        for _, next_loss, _, rng_restored in out:
            assert_close_to_reference(next_loss, loss, reduction_length=STEP_N, name="loss")
            assert not rng_restored
        for name, value in _merge([r[2] for r in out]).items():
            assert_close_to_reference(value, after[name], reduction_length=STEP_N, name=name)


def test_resharding_to_other_layouts(dist_pool: DistPool, tmp_path: Path) -> None:
    _check_resharding(dist_pool, tmp_path, {"tp": 2, "pp": 2, "vpp": 2}, [({"tp": 1}, 4), ({}, 1)])


def test_resharding_at_scale(dist_pool: DistPool, tmp_path: Path) -> None:
    """tp2·pp2·dp2 with its optimizer state split over dp2 resumes on 8 ranks at dp8 and tp4·dp2.

    Micro-batches of 1 sequence, so that each of dp8's ranks gets one of the 8 a step.
    """
    saved_at: dict[str, object] = {"tp": 2, "pp": 2, "distributed_optimizer": True}
    _check_resharding(dist_pool, tmp_path, saved_at, [({}, 8), ({"tp": 4}, 8)], micro=1)


# 3. a save killed before its commit ------------------------------------------------------


def _killed_save(run_dir: str) -> None:
    root = Path(run_dir)
    a = _Run({"tp": 2}, MODEL)
    a.step(0)
    save_checkpoint(root, 1, a.built, a.groups, a.state())
    at_step_1 = a.full_weights()
    a.step(1)

    def killed(*args: Any) -> None:
        raise RuntimeError("killed")

    commit = save_module._commit
    save_module._commit = killed  # the DCP files and meta.json are written, nothing renamed
    try:
        with pytest.raises(RuntimeError, match="killed"):
            save_checkpoint(root, 2, a.built, a.groups, a.state())
    finally:
        save_module._commit = commit
    # the kill skipped the commit's barrier: wait for rank 0 to finish writing meta.json
    dist.barrier()
    ckpts = root / "checkpoints"
    assert (ckpts / "step_00000002.tmp" / "meta.json").is_file()
    assert not (ckpts / "step_00000002").exists()
    assert latest_checkpoint(root) == ckpts / "step_00000001"
    b = _Run({"tp": 2}, MODEL, seed=99)
    load_checkpoint(ckpts / "step_00000001", b.built, b.groups)
    assert all(torch.equal(v, at_step_1[k]) for k, v in b.full_weights().items())
    save_checkpoint(root, 2, a.built, a.groups, a.state())
    dist.barrier()
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000001", "step_00000002"]
    assert latest_checkpoint(root) == ckpts / "step_00000002"


def test_killed_save_leaves_previous_checkpoint(dist_pool: DistPool, tmp_path: Path) -> None:
    dist_pool.run(_killed_save, 4, args=(str(tmp_path),))


# 4. keep_last, describe, bad checkpoints -------------------------------------------------


def _errors(run_dir: str) -> dict[str, str]:
    root = Path(run_dir)
    assert latest_checkpoint(root) is None
    a = _Run({}, MODEL)
    for step in (1, 2, 3):
        a.step(step)
        save_checkpoint(root, step, a.built, a.groups, a.state(consumed_samples=8 * step))
    ckpts = root / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    good = latest_checkpoint(root)
    assert good == ckpts / "step_00000003"
    out = {"describe": describe_checkpoint(good, tensors=True)}

    def broken(name: str) -> Path:
        path = root / name
        shutil.copytree(good, path)
        return path

    (broken("no_meta") / "meta.json").unlink()
    (broken("bad_meta") / "meta.json").write_text('{"format": "mega_pre')
    data = next(broken("truncated").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    cases = {
        "missing": (root / "nope", a),
        "no_meta": (root / "no_meta", a),
        "bad_meta": (root / "bad_meta", a),
        "truncated": (root / "truncated", a),
        "shape": (good, _Run({}, {**MODEL, "hidden_size": 32})),
        "extra": (good, _Run({}, {**MODEL, "num_layers": 2})),
    }
    for name, (path, run) in cases.items():
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(path, run.built, run.groups)
        out[name] = str(info.value)
    with pytest.raises(ValueError) as info:
        save_checkpoint(root, 4, a.built, a.groups, a.state(), keep_last=0)
    out["keep_last"] = str(info.value)
    return out


def test_keep_last_describe_and_bad_checkpoints(dist_pool: DistPool, tmp_path: Path) -> None:
    out = dist_pool.run(_errors, 1, args=(str(tmp_path),))[0]
    text = out.pop("describe")
    assert "step: 3" in text
    assert "layout: tp=1 pp=1 cp=1 dp=1 ep=1 vpp=None world_size=1" in text
    assert "consumed_samples = 24" in text
    assert "model/embedding.word.weight/tp0of1 [257, 64] float32" in text
    assert "optim/layers.3.mlp" in text
    expected = {
        "missing": "checkpoint folder .*/nope does not exist",
        "no_meta": "has no meta.json, so its save did not finish",
        "bad_meta": "meta.json is not valid JSON",
        "truncated": "checkpoint file .*/truncated/__0_0.distcp is \\d+ bytes but was saved with",
        "shape": "parameter 'embedding.word.weight' has shape \\(257, 64\\) in checkpoint",
        "extra": "holds parameter 'layers.2.",
        "keep_last": "keep_last \\(0\\) must be a positive integer",
    }
    for name, pattern in expected.items():
        assert "\n" not in out[name], out[name]
        assert __import__("re").search(pattern, out[name]), (name, out[name])
    json.dumps(out)
