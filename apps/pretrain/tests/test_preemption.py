"""Preemption as examples/slurm_8b.sbatch meets it: SIGTERM to torchrun, the workers save and
record a clean end, examples/slurm_exit_status.sh counts it as success, a new run resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from mega_pretrain.signals import RUN_END_FILE, write_run_end

EXIT_STATUS = Path(__file__).resolve().parents[3] / "examples" / "slurm_exit_status.sh"
SETTINGS = ["--train.steps", "100000", "--train.log_interval", "1", "--train.seq_len", "32",
            "--train.micro_batch_size", "2", "--train.global_batch_size", "8",
            "--train.eval_interval", "0", "--run.tensorboard", "false",
            "--checkpoint.save_interval", "0", "--run.name", "pre"]  # fmt: skip
TIMEOUT_S = 240  # a bound for a loaded machine, not an expected duration


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _exit_status(run_dir: Path) -> tuple[int, str]:
    done = subprocess.run(
        ["bash", str(EXIT_STATUS), str(run_dir)], capture_output=True, text=True, check=False
    )
    return done.returncode, done.stdout + done.stderr


def _run_end(run_dir: Path) -> dict[str, str]:
    lines = (run_dir / RUN_END_FILE).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines)


def test_sigterm_to_torchrun_saves_and_the_next_run_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "pre"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "--shutdown-timeout", "120",
               "-m", "mega_pretrain", *SETTINGS]  # fmt: skip
    with (
        open(tmp_path / "torchrun.err", "w") as err,
        subprocess.Popen(
            command, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=err, text=True
        ) as proc,
    ):
        watchdog = threading.Timer(TIMEOUT_S, proc.kill)  # no hang if training never starts
        watchdog.start()
        try:
            assert proc.stdout is not None
            line = ""
            for line in proc.stdout:
                if line.startswith("step") and "loss" in line:  # a step is trained
                    proc.send_signal(signal.SIGTERM)  # to torchrun only: it forwards it
                    break
            out = line + proc.stdout.read()
            proc.wait()
        finally:
            watchdog.cancel()
    log = out + (tmp_path / "torchrun.err").read_text()
    # torchrun exits 1 after a signal (SignalException), whatever its workers did: the run
    # folder decides
    assert proc.returncode == 1, log
    assert "stopped by SIGTERM" in out, log
    code, said = _exit_status(run_dir)
    assert code == 10, said + log
    assert "stopped by SIGTERM" in said
    end = _run_end(run_dir)
    step = int(end["step"])
    assert step >= 1
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == end["checkpoint"]

    # a new run (one process here) resumes from latest and goes one step further
    (run_dir / RUN_END_FILE).unlink()  # as the sbatch script does before each attempt
    again = [
        sys.executable,
        "-m",
        "mega_pretrain",
        *SETTINGS,
        "--train.exit_interval",
        str(step + 1),
    ]
    done = subprocess.run(
        again, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"at step {step}" in done.stdout, done.stdout
    assert _run_end(run_dir)["step"] == str(step + 1)
    assert _exit_status(run_dir)[0] == 10  # stopped by exit_interval, steps left


def test_exit_status_reads_only_a_committed_end(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step_00000007").mkdir(parents=True)
    (checkpoints / "latest").write_text("step_00000007\n")
    assert _exit_status(tmp_path)[0] == 1  # no end recorded: failed or killed
    write_run_end(
        tmp_path, stopped_by=None, step=7, steps=7, checkpoint=checkpoints / "step_00000007"
    )
    assert _exit_status(tmp_path) == (
        0,
        f"{tmp_path}: done at step 7 of 7, checkpoint step_00000007\n",
    )
    write_run_end(
        tmp_path, stopped_by="SIGTERM", step=7, steps=9, checkpoint=checkpoints / "step_00000007"
    )
    assert _exit_status(tmp_path)[0] == 10
    (checkpoints / "latest").write_text("step_00000005\n")  # the end's save is not the latest
    assert _exit_status(tmp_path)[0] == 1
