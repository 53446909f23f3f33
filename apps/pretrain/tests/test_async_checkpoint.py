"""``checkpoint.async_save``: the background write keeps every guarantee of the blocking save.

Exact resume (an async run's checkpoint equals the sync run's: weights, optimizer state,
data position, RNG), the commit only once every rank's write finished (the slow rank's
write is held back by the test), the staged copy unaffected by the steps that follow, keep-
last pruning only after the commit, a write error raised on every rank in one sentence, a
kill -9 during the background write, and SIGTERM during it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_pretrain.build import Built, build, parallel_config
from mega_pretrain.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from mega_pretrain.ckpt import async_save as async_module
from mega_pretrain.ckpt.async_save import AsyncSaver, HostStager
from mega_pretrain.config import load_config
from mega_pretrain.train import train

COMMON = [
    ("train.steps", "8"), ("train.log_interval", "1"), ("train.seq_len", "32"),
    ("train.micro_batch_size", "2"), ("train.global_batch_size", "8"), ("train.eval_interval", "0"),
    ("train.eps", "1e-5"), ("run.tensorboard", "false"), ("model.num_layers", "2"),
]  # fmt: skip
TIMEOUT_S = 240  # a bound for a loaded machine, not an expected duration


def _train(out_dir: str, name: str, extra: list[tuple[str, str]]) -> list[float]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = load_config(None, [*COMMON, ("run.out_dir", out_dir), ("run.name", name), *extra])
    return train(config).losses


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def _contents(path: Path) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    """A checkpoint's tensors, its meta.json but the file digests and the run's config, and
    each rank's RNG states."""
    dcp_to_torch_save(path, path.parent / f"{path.name}.pt")
    tensors = torch.load(path.parent / f"{path.name}.pt", weights_only=True)
    meta = json.loads((path / "meta.json").read_text())
    meta.pop("files")
    meta["trainer_state"].pop("config")
    rng = [torch.load(f, weights_only=True) for f in sorted((path / "rng").iterdir())]
    return tensors, meta, rng


def test_async_resume_is_exact_and_equals_the_sync_checkpoint(
    dist_pool: DistPool, tmp_path: Path
) -> None:
    tp2 = [("tp", "2"), ("checkpoint.save_interval", "4")]
    straight = dist_pool.run(_train, 2, args=(str(tmp_path), "sync", tp2))[0]
    on = [*tp2, ("checkpoint.async_save", "true")]
    first = dist_pool.run(
        _train, 2, args=(str(tmp_path), "async", [*on, ("train.exit_interval", "6")])
    )[0]
    assert len(first) == 6
    assert latest_checkpoint(tmp_path / "async") == tmp_path / "async/checkpoints/step_00000006"
    dist_pool.run(_train, 2, args=(str(tmp_path), "async", on))
    assert _losses(tmp_path / "async") == straight  # bit-identical, every step
    sync_ckpt = latest_checkpoint(tmp_path / "sync")
    async_ckpt = latest_checkpoint(tmp_path / "async")
    assert sync_ckpt is not None and async_ckpt is not None and async_ckpt.name == sync_ckpt.name
    sync_tensors, sync_meta, sync_rng = _contents(sync_ckpt)
    async_tensors, async_meta, async_rng = _contents(async_ckpt)
    assert async_meta == sync_meta  # step, data position, optimizer settings, every index
    assert async_tensors.keys() == sync_tensors.keys()
    for key, value in sync_tensors.items():
        assert torch.equal(async_tensors[key], value), key
    for a, s in zip(async_rng, sync_rng, strict=True):
        assert torch.equal(a["cpu"], s["cpu"])
        assert all(torch.equal(a["tracker"][k], v) for k, v in s["tracker"].items())


# staging ---------------------------------------------------------------------------------


def _check_stager(device: str, pin: bool) -> None:
    stager = HostStager(pin)
    live = {"a": torch.arange(6.0, device=device).view(2, 3), "b": torch.ones(4, device=device)}
    first = stager.stage(live)
    assert all(t.device.type == "cpu" and t.is_pinned() == pin for t in first.values())
    live["a"].add_(10.0)  # the step after the save: the staged copy keeps the saved values
    assert torch.equal(first["a"], torch.arange(6.0).view(2, 3))
    live["c"] = torch.zeros(2, device=device, dtype=torch.bfloat16)
    second = stager.stage(live)  # the next save reuses the buffers of tensors it had
    assert second["a"].data_ptr() == first["a"].data_ptr()
    assert torch.equal(second["a"], live["a"].cpu()) and second["c"].dtype == torch.bfloat16


def test_staging_copies_into_kept_host_buffers() -> None:
    _check_stager("cpu", pin=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging is the GPU path")
def test_staging_from_the_gpu_into_pinned_buffers() -> None:
    _check_stager("cuda", pin=True)


# the background write of one rank held back ----------------------------------------------


def _build(seed: int) -> tuple[Built, Any]:
    config = load_config(None, [*COMMON, ("tp", "2"), ("train.seed", str(seed))])
    groups = init_process_groups(parallel_config(config))
    return build(config, groups, rank_device()), groups


def _weights(built: Built) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in built.ddp.named_parameters()}


def _held_back_write(run_dir: str) -> None:
    root, rank = Path(run_dir), dist.get_rank()
    built, groups = _build(1234)
    saver = AsyncSaver(pin=False, timeout=timedelta(minutes=4))
    release = threading.Event()
    original = async_module._StagedWriter.write_data

    def held(self: Any, plan: Any, planner: Any) -> Any:
        if rank == 1:
            assert release.wait(TIMEOUT_S)
        return original(self, plan, planner)

    try:
        saver.save(root, 1, built, groups, {"step": 1}, keep_last=1)
        assert saver.wait() == root / "checkpoints/step_00000001"
        async_module._StagedWriter.write_data = held  # type: ignore[method-assign]
        at_save = _weights(built)
        assert saver.save(root, 2, built, groups, {"step": 2}, keep_last=1).name == "step_00000002"
        with torch.no_grad():  # training goes on while the save is written
            for p in built.ddp.parameters():
                p.add_(1.0)
        assert saver.poll() is None  # rank 1 is still writing: nobody commits
        ckpts = root / "checkpoints"
        if rank == 0:
            assert latest_checkpoint(root) == ckpts / "step_00000001"
            assert (ckpts / "step_00000001").is_dir()  # not pruned before the commit
            assert not (ckpts / "step_00000002").exists()
            assert (ckpts / "step_00000002.tmp").is_dir()
        dist.barrier()
        release.set()
        assert saver.wait() == ckpts / "step_00000002"
        dist.barrier()
        assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]
        fresh, groups2 = _build(99)
        load_checkpoint(ckpts / "step_00000002", fresh, groups2)
        for name, value in _weights(fresh).items():
            assert torch.equal(value, at_save[name]), name  # the values at the save
    finally:
        async_module._StagedWriter.write_data = original  # type: ignore[method-assign]
        saver.close()


def test_the_commit_waits_for_every_rank_and_prunes_after(
    dist_pool: DistPool, tmp_path: Path
) -> None:
    dist_pool.run(_held_back_write, 2, args=(str(tmp_path),))


def _failed_write(run_dir: str) -> str:
    root, rank = Path(run_dir), dist.get_rank()
    built, groups = _build(1234)
    saver = AsyncSaver(pin=False, timeout=timedelta(minutes=4))
    original = async_module._StagedWriter.write_data

    def broken(self: Any, plan: Any, planner: Any) -> Any:
        if rank == 1:
            raise OSError("the storage went away")
        return original(self, plan, planner)

    try:
        saver.save(root, 1, built, groups, {"step": 1})
        saver.wait()
        async_module._StagedWriter.write_data = broken  # type: ignore[method-assign]
        saver.save(root, 2, built, groups, {"step": 2})
        with pytest.raises(CheckpointError) as info:
            while saver.poll() is None:  # every rank raises at the same poll
                pass
        assert saver.in_flight is None
        assert latest_checkpoint(root) == root / "checkpoints/step_00000001"
        return str(info.value)
    finally:
        async_module._StagedWriter.write_data = original  # type: ignore[method-assign]
        saver.close()


def test_a_failed_background_write_is_one_sentence_on_every_rank(
    dist_pool: DistPool, tmp_path: Path
) -> None:
    said = dist_pool.run(_failed_write, 2, args=(str(tmp_path),))
    for message in said:
        assert "\n" not in message, message
        assert message.startswith("checkpoint.async_save: writing checkpoint "), message
        assert "step_00000002.tmp failed" in message and "the storage went away" in message
        assert "latest still names step_00000001" in message, message


# a whole run killed, or stopped, during the background write -----------------------------

SETTINGS = ["--train.steps", "100000", "--train.log_interval", "1", "--train.seq_len", "32",
            "--train.micro_batch_size", "2", "--train.global_batch_size", "4",
            "--train.eval_interval", "0", "--run.tensorboard", "false", "--model.num_layers", "2",
            "--checkpoint.save_interval", "2", "--checkpoint.async_save", "true",
            "--checkpoint.keep_last", "1", "--run.name", "bg"]  # fmt: skip

#: The trainer, with a save's background write held after its tensor files are written:
#: the first save's until SIGTERM reached the trainer (``stop``: the writer's thread sends
#: it to itself once the main thread waits for the write, the delivery that cannot
#: interrupt a main thread blocked on a lock),
#: the second's for ever (``kill``, which needs a committed checkpoint before it). SIGUSR1 prints every thread's
#: stack (the watchdog's last word before it kills a trainer that did not end).
CHILD = """
import faulthandler, signal, sys, threading, time
from mega_pretrain.ckpt import async_save
from mega_pretrain import signals
from mega_pretrain.cli import main

faulthandler.register(signal.SIGUSR1, all_threads=True)
held, writes = threading.Event(), []
original_write, original_handle = async_save._StagedWriter.write_data, signals.StopRequest._handle
hold = 1 if sys.argv[1] == "stop" else 2

def main_waits_for_the_write():
    frame = sys._current_frames().get(threading.main_thread().ident)
    on_top = frame is not None and frame.f_code.co_filename.endswith("threading.py")
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename == async_save.__file__:
            return on_top
        frame = frame.f_back
    return False

def write_data(self, plan, planner):
    done = original_write(self, plan, planner)
    writes.append(1)
    if len(writes) == hold:
        print("WRITING", flush=True)
        if sys.argv[1] == "stop":  # SIGTERM reaching the writer's thread, not the main one
            while not main_waits_for_the_write():
                time.sleep(0.001)
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        held.wait()
    return done

def handle(self, signum, frame):
    original_handle(self, signum, frame)
    if sys.argv[1] == "stop":
        held.set()

async_save._StagedWriter.write_data = write_data
signals.StopRequest._handle = handle
sys.exit(main(sys.argv[2:]))
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run_until_held(tmp_path: Path, how: str, sig: signal.Signals | None) -> tuple[int, str]:
    """Start the trainer, send ``sig`` (if any) once the held write began: (code, log with
    the seconds since the start on each line)."""
    command = [sys.executable, "-c", CHILD, how, *SETTINGS]
    with subprocess.Popen(
        command, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    ) as proc:  # fmt: skip

        def stop_hung() -> None:  # no hang if the write never comes; the stacks say where
            proc.send_signal(signal.SIGUSR1)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

        watchdog = threading.Timer(TIMEOUT_S, stop_hung)
        watchdog.start()
        start, lines = time.perf_counter(), []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(f"{time.perf_counter() - start:7.1f} {line}")
                if line.startswith("WRITING") and sig is not None:
                    proc.send_signal(sig)
            proc.wait()
        finally:
            watchdog.cancel()
    return proc.returncode, "".join(lines)


def test_a_kill_during_the_background_write_loses_nothing(tmp_path: Path) -> None:
    code, log = _run_until_held(tmp_path, "kill", signal.SIGKILL)
    assert code == -signal.SIGKILL, log
    ckpts = tmp_path / "runs/bg/checkpoints"
    assert latest_checkpoint(tmp_path / "runs/bg") == ckpts / "step_00000002", log
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "latest",
        "step_00000002",
        "step_00000004.tmp",
    ]
    assert list((ckpts / "step_00000004.tmp").glob("*.distcp"))  # the write was under way
    assert not (ckpts / "step_00000004.tmp/meta.json").exists()
    again = [sys.executable, "-m", "mega_pretrain", *SETTINGS, "--train.exit_interval", "3"]
    done = subprocess.run(
        again, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checkpoints/step_00000002 at step 2" in done.stdout, done.stdout
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000003"]


def test_sigterm_during_the_background_write_saves_and_waits(tmp_path: Path) -> None:
    code, log = _run_until_held(tmp_path, "stop", None)
    assert code == 0, log
    assert "stopped by SIGTERM" in log
    assert "checkpoint step_00000002 committed" in log  # the held save, then the last one
    end = dict(
        line.split("=", 1) for line in (tmp_path / "runs/bg/run_end").read_text().splitlines()
    )
    step = int(end["step"])
    ckpts = tmp_path / "runs/bg/checkpoints"
    assert step > 2 and end["state"] == "stopped" and end["checkpoint"] == f"step_{step:08d}"
    assert latest_checkpoint(tmp_path / "runs/bg") == ckpts / f"step_{step:08d}"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", f"step_{step:08d}"]
