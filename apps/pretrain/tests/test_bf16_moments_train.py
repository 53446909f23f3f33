"""``train.optimizer_moment_dtype bf16``: the trainer's AdamW moments stored in bf16.

What is exact, and why. A resumed run replays the uninterrupted one: the checkpoint holds
the bf16 moments as they are (and the fp32 masters), so the steps after the resume read
the same bits and the losses and the final state are equal bit for bit. Resharding copies
values (bf16 moments at dp 2 load into dp 1 bitwise). A checkpoint of the other moment
dtype loads converted: fp32 moments rounded to nearest bf16 (what ``Tensor.to`` gives),
bf16 ones widened to fp32 exactly; the masters come back bitwise either way.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from mega_parallel_grid import ProcessGroups, init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device, sibling_module
from mega_pretrain.build import Built, build, flat_optimizer_kernel, gpt_config, parallel_config
from mega_pretrain.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from mega_pretrain.config import TrainerConfig, load_config
from mega_pretrain.estimate import estimate
from mega_pretrain.step import StepRunner
from mega_pretrain.train import train
from mega_pretrain.validate import check_config

_ckpt = sibling_module(__file__, "test_checkpoint")
State = dict[str, dict[str, torch.Tensor]]


# 1. configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [("train.optimizer_moment_dtype", "bf16"), ("train.optimizer_kernel", "torch")],
            "train.optimizer_moment_dtype 'bf16' keeps the moments in the flat kernel's "
            "buffers, but train.optimizer_kernel is 'torch'; use optimizer_kernel 'flat' or "
            "'auto', or optimizer_moment_dtype 'fp32'",
        ),
        (
            [("train.optimizer_moment_dtype", "bf16"), ("parallel.distributed_optimizer", "true"),
             ("parallel.optimizer_offload", "true")],
            "train.optimizer_moment_dtype 'bf16' keeps the moments on the device, but "
            "parallel.optimizer_offload true keeps fp32 state on the host; turn the offload "
            "off or use optimizer_moment_dtype 'fp32'",
        ),
    ],
    ids=["kernel-torch", "offload"],
)  # fmt: skip
def test_config_errors(overrides: list[tuple[str, str]], message: str) -> None:
    config = load_config(None, overrides)
    with pytest.raises(ValueError) as info:
        check_config(config, gpt_config(config), world_size=2)
    assert str(info.value) == message
    assert ". " not in message  # one sentence


def test_moment_dtype_names_its_values() -> None:
    with pytest.raises(
        ValueError, match=r"^train.optimizer_moment_dtype \('fp16'\) must be one of"
    ):
        load_config(None, [("train.optimizer_moment_dtype", "fp16")])


def test_moment_dtype_checked_when_built_in_python() -> None:
    config = load_config(None, [])
    bad = dataclasses.replace(
        config,
        train=dataclasses.replace(config.train, optimizer_moment_dtype="fp16"),  # type: ignore[arg-type]
    )
    with pytest.raises(
        ValueError, match=r"^train.optimizer_moment_dtype \('fp16'\) must be 'fp32' or 'bf16'$"
    ):
        check_config(bad, gpt_config(bad), world_size=1)


@pytest.mark.parametrize(
    ("kernel", "device", "moments", "flat"),
    [("auto", "cpu", "bf16", True), ("auto", "cuda", "bf16", True), ("auto", "cpu", "fp32", False),
     ("flat", "cpu", "bf16", True), ("torch", "cpu", "fp32", False)],
)  # fmt: skip
def test_auto_is_flat_with_bf16_moments_on_any_device(
    kernel: str, device: str, moments: str, flat: bool
) -> None:
    assert flat_optimizer_kernel(kernel, torch.device(device), False, moments) is flat


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_estimate_counts_two_byte_moments(precision: str) -> None:
    """The optimizer state per rank: masters (bf16 runs) and two moments, 4 bytes less an
    element with bf16 moments (at dp 1 the rank holds every element's state)."""
    sizes = {}
    for moments in ("fp32", "bf16"):
        config = load_config(
            None, [("train.precision", precision), ("train.optimizer_moment_dtype", moments)]
        )
        sizes[moments] = estimate(check_config(config, gpt_config(config), world_size=1))
    params = sizes["fp32"].params_per_rank
    master = 4 if precision == "bf16" else 0
    assert sizes["fp32"].optimizer == params * (master + 8)
    assert sizes["bf16"].optimizer == params * (master + 4)


# 2. the trainer: loss goes down, and a resume is exact ------------------------------------------

COMMON = [
    ("model.num_layers", "2"), ("train.steps", "6"), ("train.log_interval", "1"),
    ("train.seq_len", "32"), ("train.micro_batch_size", "2"), ("train.global_batch_size", "4"),
    ("train.eval_interval", "0"), ("train.precision", "bf16"), ("train.warmup_steps", "0"),
    ("train.optimizer_moment_dtype", "bf16"), ("run.tensorboard", "false"),
    ("checkpoint.save_interval", "0"),
]  # fmt: skip


def _train(out_dir: str, name: str, extra: list[tuple[str, str]]) -> tuple[list[float], State]:
    """The trainer's run ``name``: its losses, and the optimizer state of its last checkpoint."""
    os.environ["MEGA_PRETRAIN_CACHE"] = str(Path(out_dir) / "cache")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = load_config(None, [*COMMON, ("run.out_dir", out_dir), ("run.name", name), *extra])
    summary = train(config)
    assert summary.checkpoint is not None
    groups = init_process_groups(parallel_config(config))
    built = build(config, groups, rank_device())
    assert built.optimizer._flat is not None, "auto must choose the flat step on the CPU too"
    load_checkpoint(summary.checkpoint, built, groups)
    return summary.losses, _state(built)


def _state(built: Built) -> State:
    out: State = {}
    for name, entry in built.optimizer.state_dict()["params"].items():
        for piece in entry["pieces"]:
            fields = {"master": piece["master"], **piece["state"]}
            for key, value in fields.items():
                out.setdefault(name, {})[f"{piece['start']} {key}"] = value.detach().cpu().clone()
    return out


def _logged_losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def test_trains_and_resumes_exactly(dist_pool: DistPool, tmp_path: Path) -> None:
    out = str(tmp_path)
    straight, final = dist_pool.run(_train, 1, args=(out, "straight", []))[0]
    assert len(straight) == 6 and straight[-1] < straight[0] - 0.1, straight
    stopped, saved = dist_pool.run(_train, 1, args=(out, "resumed", [("train.exit_interval", "3")]))[0]  # fmt: skip
    assert len(stopped) == 3
    for fields in saved.values():
        for key, value in fields.items():
            if key.endswith(("exp_avg", "exp_avg_sq")):
                assert value.dtype == torch.bfloat16, key  # saved as the run keeps them
    resumed, state = dist_pool.run(_train, 1, args=(out, "resumed", []))[0]
    assert len(resumed) == 3
    assert _logged_losses(tmp_path / "resumed") == straight  # bit for bit
    assert state.keys() == final.keys()
    for name, fields in state.items():
        assert fields.keys() == final[name].keys(), name
        for key, value in fields.items():
            want = final[name][key]
            assert value.dtype == want.dtype and torch.equal(value, want), f"{name} {key}"


# 3. checkpoints: across moment dtypes, and resharded ---------------------------------------------


class _Run:
    """test_checkpoint's run (tiny GPT, 4 layers, fp32) with the moments in ``moments``."""

    def __init__(self, layout: dict[str, object], moments: str, seed: int = 1234) -> None:
        config = _ckpt._config(layout, _ckpt.MODEL, seed, _ckpt.MICRO)
        self.config: TrainerConfig = dataclasses.replace(
            config, train=dataclasses.replace(config.train, optimizer_moment_dtype=moments)
        )
        self.groups: ProcessGroups = init_process_groups(parallel_config(self.config))
        self.built: Built = build(self.config, self.groups, rank_device())
        self.runner = StepRunner(
            self.built, self.groups, seq_len=_ckpt.SEQ, micro_batch_size=_ckpt.MICRO,
            hidden_size=gpt_config(self.config).hidden_size, dtype=torch.float32,
            device=rank_device(), sequence_parallel=False,
        )  # fmt: skip
        self.micro = _ckpt.MICRO

    step = _ckpt._Run.step
    state = _ckpt._Run.state


#: every element's optimizer state from every rank's pieces, in the dtypes it is kept in
_full_state = sibling_module(__file__, "test_zero_checkpoint")._full_state


def _save(run_dir: str, layout: dict[str, object], moments: str) -> Any:
    run = _Run(layout, moments)
    for step in range(2):
        run.step(step)
    save_checkpoint(Path(run_dir), 2, run.built, run.groups, run.state())
    return _full_state(run)


def _load(run_dir: str, layout: dict[str, object], moments: str) -> Any:
    run = _Run(layout, moments, seed=99)
    path = latest_checkpoint(Path(run_dir))
    assert path is not None
    load_checkpoint(path, run.built, run.groups)
    state = _full_state(run)
    loss = run.step(2)  # steps on from the loaded moments
    assert torch.isfinite(torch.tensor(loss))
    return state


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [(("fp32", 1), ("bf16", 1)), (("bf16", 1), ("fp32", 1)), (("bf16", 2), ("bf16", 1))],
    ids=["fp32-to-bf16", "bf16-to-fp32", "bf16-dp2-to-dp1"],
)
def test_checkpoint_loads_across_moment_dtypes(
    dist_pool: DistPool, tmp_path: Path, saved: tuple[str, int], loaded: tuple[str, int]
) -> None:
    layout = {"distributed_optimizer": True}
    want = dist_pool.run(_save, saved[1], args=(str(tmp_path), layout, saved[0]))[0]
    got = dist_pool.run(_load, loaded[1], args=(str(tmp_path), layout, loaded[0]))[0]
    dtype = torch.bfloat16 if loaded[0] == "bf16" else torch.float32
    assert got.keys() == want.keys()
    for name, fields in got.items():
        assert fields.keys() == want[name].keys() == {"master", "exp_avg", "exp_avg_sq", "step"}
        assert torch.equal(fields["master"], want[name]["master"]), name
        assert float(fields["step"]) == float(want[name]["step"]) == 2
        for key in ("exp_avg", "exp_avg_sq"):
            saved_value = want[name][key]
            assert saved_value.dtype == (torch.bfloat16 if saved[0] == "bf16" else torch.float32)
            assert fields[key].dtype == dtype, f"{name} {key}"
            assert torch.equal(fields[key], saved_value.to(dtype)), f"{name} {key}"
