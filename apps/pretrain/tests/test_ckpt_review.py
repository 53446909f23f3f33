"""Checkpoints of MoE models whose expert layout differs from the dense one.

Mixtral-style tiny model (2 layers of 8 experts, GroupedMLP stacked weights by default).
A save and a load at the same layout must give back every rank's weights and optimizer
state bitwise, so the step after loading equals the step after the save exactly (same
layout, same reduction order, RNG restored): no tolerance.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_pretrain.build import Built, build, gpt_config, parallel_config
from mega_pretrain.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from mega_pretrain.config import load_config
from mega_pretrain.step import StepRunner

SEQ, MICRO, GLOBAL = 16, 2, 8


class _Run:
    def __init__(self, layout: list[tuple[str, str]], seed: int) -> None:
        pairs = [
            ("model.size", "mixtral-tiny"), ("model.num_layers", "2"),
            ("train.seq_len", str(SEQ)), ("train.micro_batch_size", str(MICRO)),
            ("train.global_batch_size", str(GLOBAL)), ("train.seed", str(seed)), *layout,
        ]  # fmt: skip
        config = load_config(None, pairs)
        self.groups = init_process_groups(parallel_config(config))
        self.built: Built = build(config, self.groups, rank_device())
        self.vocab = gpt_config(config).vocab_size
        self.runner = StepRunner(
            self.built, self.groups, seq_len=SEQ, micro_batch_size=MICRO,
            hidden_size=gpt_config(config).hidden_size, dtype=torch.float32,
            device=rank_device(), sequence_parallel=False,
        )  # fmt: skip

    def step(self, step: int) -> float:
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, self.vocab, (GLOBAL, SEQ + 1), generator=gen)
        batches = [(tokens[i : i + MICRO, :-1], tokens[i : i + MICRO, 1:])
                   for i in range(0, GLOBAL, MICRO)]  # fmt: skip
        dp, rank = self.groups.size("dp"), self.groups.rank("dp")
        loss, _ = self.runner.train_step(batches[rank::dp], 1e-3)
        return float(loss)

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.built.chunks[0].named_parameters()}


def _moe_round_trip(run_dir: str, layout: list[tuple[str, str]]) -> list[str]:
    """Names of this rank's parameters that differ after load, or after the next step."""
    a = _Run(layout, seed=1234)
    a.step(0)
    path = save_checkpoint(Path(run_dir), 1, a.built, a.groups, {"step": 1})
    saved = a.weights()
    loss = a.step(1)
    after = a.weights()
    torch.manual_seed(5)
    b = _Run(layout, seed=99)  # other initial weights
    state = load_checkpoint(path, b.built, b.groups)
    assert state["rng_restored"]
    bad = [f"loaded {n}" for n, v in b.weights().items() if not torch.equal(v, saved[n])]
    if b.step(1) != loss:
        bad.append("loss of the next step")
    bad += [f"stepped {n}" for n, v in b.weights().items() if not torch.equal(v, after[n])]
    return bad


@pytest.mark.parametrize(
    ("layout", "world"),
    [
        ([("parallel.tp", "2")], 2),  # etp 2: each etp rank holds its slice of every expert
        ([("parallel.tp", "2"), ("parallel.etp", "1")], 4),  # edp (4) spans the tp ranks
        ([("parallel.tp", "2"), ("parallel.etp", "1"), ("model.moe_grouped_experts", "false")], 4),
    ],
    ids=["grouped-etp2", "grouped-etp1-tp2", "sequential-etp1-tp2"],
)
def test_moe_round_trip_is_exact_when_etp_differs_from_dp_layout(
    dist_pool: DistPool, tmp_path: Path, layout: list[tuple[str, str]], world: int
) -> None:
    out = dist_pool.run(_moe_round_trip, world, args=(str(tmp_path), layout))
    assert out == [[]] * world, out


def _etp_change(run_dir: str) -> str:
    a = _Run([("parallel.tp", "2")], seed=1234)
    path = save_checkpoint(Path(run_dir), 1, a.built, a.groups, {"step": 1})
    b = _Run([("parallel.tp", "2"), ("parallel.etp", "1")], seed=1234)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, b.built, b.groups)
    return str(info.value)


def test_stacked_experts_at_another_etp_are_refused_in_one_sentence(
    dist_pool: DistPool, tmp_path: Path
) -> None:
    message = dist_pool.run(_etp_change, 2, args=(str(tmp_path),))[0]
    assert "\n" not in message
    assert "split over etp 2 in checkpoint" in message and "over etp 1 here" in message, message
    assert "resume with parallel.etp 2" in message, message


def _run_folder_passed(run_dir: str) -> dict[str, str]:
    run = _Run([], seed=1234)
    path = save_checkpoint(Path(run_dir), 3, run.built, run.groups, {"step": 3})
    out = {}
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path / "meta.json", run.built, run.groups)
    out["file"] = str(info.value)
    for name, given in {"run": Path(run_dir), "checkpoints": path.parent}.items():
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(given, run.built, run.groups)
        out[name] = str(info.value)
    return out


def test_a_run_folder_passed_as_checkpoint_names_the_checkpoint_in_it(
    dist_pool: DistPool, tmp_path: Path
) -> None:
    """Not "its save did not finish; load an earlier checkpoint": nothing failed, the
    user passed the folder above the checkpoint."""
    out = dist_pool.run(_run_folder_passed, 1, args=(str(tmp_path),))[0]
    file = out.pop("file")
    assert "meta.json is a file, not a checkpoint folder" in file and "does not exist" not in file
    for name, message in out.items():
        assert "\n" not in message
        assert "did not finish" not in message, (name, message)
        assert "is a run or checkpoints folder, not a checkpoint folder" in message, message
        assert str(tmp_path / "checkpoints" / "step_00000003") in message, message
