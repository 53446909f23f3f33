"""The trainer end to end on CPU: layouts agree with one process, resume is exact, SIGTERM saves."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from mega_parallel_grid.testing import DistPool
from mega_pretrain.config import load_config
from mega_pretrain.train import train

COMMON = [
    ("train.steps", "10"), ("train.log_interval", "1"), ("train.seq_len", "32"),
    ("train.micro_batch_size", "2"), ("train.global_batch_size", "8"), ("train.eval_interval", "5"),
    ("train.eps", "1e-5"), ("run.tensorboard", "false"), ("checkpoint.save_interval", "0"),
]  # fmt: skip


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def _train(
    out_dir: str, name: str, extra: list[tuple[str, str]], console: Console | None = None
) -> list[float]:
    os.environ["MEGA_PRETRAIN_CACHE"] = str(Path(out_dir) / "cache")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the pool's ranks share the machine's cores
    config = load_config(None, [*COMMON, ("run.out_dir", out_dir), ("run.name", name), *extra])
    summary = train(config, console=console)
    return summary.losses


def _printed(out_dir: str, name: str, extra: list[tuple[str, str]]) -> str:
    """What a run prints (rank 0), as a piped log would hold it."""
    buffer = io.StringIO()
    _train(out_dir, name, extra, Console(file=buffer, soft_wrap=True))
    return buffer.getvalue()


@pytest.mark.parametrize(
    "layout",
    [
        [("tp", "2"), ("pp", "2")],
        [("tp", "2"), ("parallel.sequence_parallel", "true")],
        [("cp", "2")],
    ],
    ids=["tp2-pp2", "tp2-sp-dp2", "cp2-dp2"],
)
def test_layouts_train_like_one_process(
    dist_pool: DistPool, tmp_path: Path, layout: list[tuple[str, str]]
) -> None:
    reference = dist_pool.run(_train, 1, args=(str(tmp_path), "one", []))[0]
    parallel = dist_pool.run(_train, 4, args=(str(tmp_path), "four", layout))
    # fp32 on CPU: the same computation in another order of float sums (see
    # tests/test_gpt_training_layouts.py for the reasoning behind the tolerance)
    for losses in parallel:
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-5
        )
    assert reference[-1] < reference[0]


def test_resume_is_exact(dist_pool: DistPool, tmp_path: Path) -> None:
    straight = dist_pool.run(_train, 2, args=(str(tmp_path), "straight", [("tp", "2")]))[0]
    first = dist_pool.run(
        _train, 2, args=(str(tmp_path), "resumed", [("tp", "2"), ("train.exit_interval", "5")])
    )[0]
    assert len(first) == 5
    dist_pool.run(_train, 2, args=(str(tmp_path), "resumed", [("tp", "2")]))
    assert _losses(tmp_path / "resumed") == straight  # bit-identical, every step


def test_resume_at_another_layout(dist_pool: DistPool, tmp_path: Path) -> None:
    """Saved at tp2*pp2 on 4 ranks, continued on one process: the loss goes on from there."""
    dist_pool.run(
        _train,
        4,
        args=(str(tmp_path), "moved", [("tp", "2"), ("pp", "2"), ("train.exit_interval", "5")]),
    )
    straight = dist_pool.run(_train, 4, args=(str(tmp_path), "ref", [("tp", "2"), ("pp", "2")]))[0]
    dist_pool.run(_train, 1, args=(str(tmp_path), "moved", []))
    torch.testing.assert_close(
        torch.tensor(_losses(tmp_path / "moved")), torch.tensor(straight), rtol=1e-5, atol=1e-5
    )


def test_sigterm_saves_and_exits_zero(tmp_path: Path) -> None:
    env = {**os.environ, "MEGA_PRETRAIN_CACHE": str(tmp_path / "cache")}
    env.pop("WORLD_SIZE", None)
    args = [sys.executable, "-m", "mega_pretrain", "--train.steps", "100000", "--train.log_interval", "1",
            "--run.tensorboard", "false", "--checkpoint.save_interval", "0"]  # fmt: skip
    with subprocess.Popen(
        args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step") and "loss" in line:  # training is under way
                proc.send_signal(signal.SIGTERM)
                break
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopped by SIGTERM" in out
    latest = (tmp_path / "runs/tiny/checkpoints/latest").read_text().strip()
    assert latest.startswith("step_") and int(latest[5:]) < 100000


def _resume_with(out_dir: str, extra: list[tuple[str, str]]) -> tuple[str, list[float]]:
    """Train 3 steps and stop, then resume with ``extra``: the error, or the weight decay
    and betas the optimizer runs with after the resume."""
    _train(out_dir, "changed", [("train.exit_interval", "3"), ("train.eval_interval", "0")])
    os.environ["MEGA_PRETRAIN_CACHE"] = str(Path(out_dir) / "cache")
    base = [*COMMON, ("train.eval_interval", "0"), ("run.out_dir", out_dir)]
    config = load_config(None, [*base, ("run.name", "changed"), *extra])
    import mega_pretrain.train as train_module

    seen: list[float] = []
    original = train_module.apply_optimizer_settings

    def spy(optimizer: object, t: object) -> list[str]:
        notes = original(optimizer, t)  # type: ignore[arg-type]
        groups = optimizer.optimizer.param_groups  # type: ignore[attr-defined]
        seen.extend([groups[0]["weight_decay"], groups[1]["weight_decay"], *groups[0]["betas"]])
        return notes

    train_module.apply_optimizer_settings = spy  # type: ignore[assignment]
    try:
        train(config)
    except ValueError as exc:
        return str(exc), seen
    finally:
        train_module.apply_optimizer_settings = original
    return "", seen


def test_resume_keeps_this_runs_optimizer_settings(dist_pool: DistPool, tmp_path: Path) -> None:
    extra = [("train.weight_decay", "0.5"), ("train.beta2", "0.99")]
    error, seen = dist_pool.run(_resume_with, 1, args=(str(tmp_path), extra))[0]
    assert error == ""
    assert seen == [0.5, 0.0, 0.9, 0.99]  # not the checkpoint's 0.1 and 0.95


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([("train.seq_len", "16")], "was trained with train.seq_len 32 but this run has 16"),
        ([("train.seed", "9")], "was trained with train.seed 1234 but this run has 9"),
        ([("train.steps", "2")], "is at step 3 but train.steps is 2; raise train.steps"),
    ],
    ids=["seq_len", "seed", "steps"],
)
def test_resume_that_cannot_continue_is_one_sentence(
    dist_pool: DistPool, tmp_path: Path, extra: list[tuple[str, str]], message: str
) -> None:
    error, _ = dist_pool.run(_resume_with, 1, args=(str(tmp_path), extra))[0]
    assert message in error


def _skip_second_step(out_dir: str) -> tuple[int, str | None, list[int]]:
    """Step 2 has non-finite gradients under nan_policy skip, and exit_interval is 2: the
    skipped step still counts, and the run still stops and saves at step 2."""
    from mega_pretrain.step import StepRunner

    original = StepRunner.train_step
    calls = {"n": 0}

    def flaky(self: StepRunner, batches: Any, lr: float, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise FloatingPointError("non-finite gradient norm (injected)")
        return original(self, batches, lr, **kwargs)  # kwargs: the trainer's phase timer

    StepRunner.train_step = flaky  # type: ignore[method-assign]
    try:
        os.environ["MEGA_PRETRAIN_CACHE"] = str(Path(out_dir) / "cache")
        extra = [("train.nan_policy", "skip"), ("train.exit_interval", "2"),
                 ("train.eval_interval", "0"), ("run.out_dir", out_dir), ("run.name", "skip")]  # fmt: skip
        summary = train(load_config(None, [*COMMON, *extra]))
    finally:
        StepRunner.train_step = original  # type: ignore[method-assign]
    lines = (Path(out_dir) / "skip" / "metrics.jsonl").read_text().splitlines()
    logged = [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"]
    return summary.last_step, summary.stopped_by, logged


def test_a_skipped_step_still_counts_for_exit_and_save(dist_pool: DistPool, tmp_path: Path) -> None:
    last, stopped_by, logged = dist_pool.run(_skip_second_step, 1, args=(str(tmp_path),))[0]
    assert (last, stopped_by) == (2, "exit_interval")
    assert logged == [1]  # the skipped step logs no loss
    assert (tmp_path / "skip" / "checkpoints" / "step_00000002").is_dir()


def _snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in run_dir.rglob("*")}


def _run_twice(out_dir: str) -> tuple[str, dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
    extra = [("train.steps", "2"), ("train.eval_interval", "0"), ("run.tensorboard", "true")]
    _train(out_dir, "done", extra)
    before = _snapshot(Path(out_dir) / "done")
    again = _printed(out_dir, "done", extra)
    return again, before, _snapshot(Path(out_dir) / "done")


def test_a_finished_run_is_left_alone(dist_pool: DistPool, tmp_path: Path) -> None:
    """Running a complete run again says so and touches nothing: no checkpoint rewrite, no
    second TensorBoard event file, no metrics line."""
    printed, before, after = dist_pool.run(_run_twice, 1, args=(str(tmp_path),))[0]
    assert printed.strip() == (
        "run `done` is already complete at step 2; raise `--train.steps` to continue"
    )
    assert after == before
    assert any("tfevents" in name for name in before)


def _rerun_without_end_marker(out_dir: str) -> str:
    extra = [("train.steps", "2"), ("train.eval_interval", "0")]
    _train(out_dir, "requeued", extra)
    end = Path(out_dir) / "requeued" / "run_end"
    end.unlink()  # what a job script does before each attempt
    _printed(out_dir, "requeued", extra)
    return end.read_text()


def test_a_requeued_finished_run_records_its_end(dist_pool: DistPool, tmp_path: Path) -> None:
    """A job script that removed run_end before an attempt of an already finished run
    finds it again (state done), so the attempt counts as a success."""
    text = dist_pool.run(_rerun_without_end_marker, 1, args=(str(tmp_path),))[0]
    assert "state=done\n" in text and "step=2\n" in text and "checkpoint=step_00000002" in text


def _resume_longer(out_dir: str) -> str:
    _train(out_dir, "longer", [("train.exit_interval", "3"), ("train.eval_interval", "0")])
    return _printed(out_dir, "longer", [("train.steps", "12"), ("train.eval_interval", "0")])


def test_a_resume_that_changes_the_steps_says_so(dist_pool: DistPool, tmp_path: Path) -> None:
    printed = dist_pool.run(_resume_longer, 1, args=(str(tmp_path),))[0]
    assert (
        "train.steps changed on resume: 10 -> 12; the cosine learning-rate schedule now "
        "runs over 12 steps" in printed
    )
    start = next(line for line in printed.splitlines() if line.startswith("mega-pretrain tiny"))
    assert ", cpu, fp32, 1 thread (OMP_NUM_THREADS), 12 steps of 256 tokens -> " in start


def _non_finite_from_the_cli(out_dir: str) -> tuple[int, str]:
    """The command line with step 1's gradient non-finite (nan_policy stop, the default)."""
    from mega_pretrain.cli import main
    from mega_pretrain.step import StepRunner

    original = StepRunner.train_step

    def broken(self: StepRunner, batches: Any, lr: float, **kwargs: Any) -> Any:
        raise FloatingPointError("step 1: the gradient of 'w' holds nan or inf (injected)")

    StepRunner.train_step = broken  # type: ignore[method-assign]
    err = io.StringIO()
    try:
        os.environ["MEGA_PRETRAIN_CACHE"] = str(Path(out_dir) / "cache")
        args = [f"--{k}={v}" for k, v in COMMON] + [f"--run.out_dir={out_dir}", "--run.name=nan"]
        with contextlib.redirect_stderr(err):
            code = main(args)
    finally:
        StepRunner.train_step = original  # type: ignore[method-assign]
    return code, err.getvalue()


def test_a_training_stop_is_one_sentence_with_status_1(dist_pool: DistPool, tmp_path: Path) -> None:
    code, err = dist_pool.run(_non_finite_from_the_cli, 1, args=(str(tmp_path),))[0]
    assert code == 1
    assert err == "error: step 1: the gradient of 'w' holds nan or inf (injected)\n"
