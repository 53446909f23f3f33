"""The mega-pretrain command: bad input in one sentence, dry run, preprocess, the default run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mega_pretrain.cli import main


def _run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    # one thread: the suite runs beside other test processes on a 2-core machine
    env = {**os.environ, "MEGA_PRETRAIN_CACHE": str(cwd / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "mega_pretrain", *args], cwd=cwd, env=env, text=True,
        capture_output=True, timeout=timeout, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--train.lr", "fast"], "train.lr ('fast') must be a number"),
        (["--train.bogus", "1"], "unknown setting 'train.bogus'"),
        (["--model.size", "huge"], "unknown model size 'huge'"),
        (
            ["--tp", "3", "--world-size", "4"],
            "world size (4) is not divisible by tp*cp*pp (3*1*1 = 3)",
        ),
        (
            ["--train.global_batch_size", "10", "--train.micro_batch_size", "4"],
            "is not divisible by micro_batch_size * dp",
        ),
        (["--parallel.sequence_parallel", "true"], "sequence_parallel needs tp > 1"),
        (
            ["--model.num_layers", "6", "--pp", "4", "--world-size", "4"],
            "num_layers (6) is not divisible into pp*vpp",
        ),
        (
            ["--pp", "2", "--parallel.pp_layers", "3,4", "--world-size", "2"],
            "parallel.pp_layers [3, 4] must give 2 positive layer counts",
        ),
        (
            ["--tp", "2", "--model.ffn_hidden_size", "129", "--world-size", "2"],
            "the FFN size (model.ffn_hidden_size, 129) is not divisible by tp (2)",
        ),
        (
            [
                "--model.size",
                "hybrid-tiny",
                "--tp",
                "2",
                "--model.mamba_num_groups",
                "1",
                "--world-size",
                "2",
            ],
            "model.mamba_num_groups (1) is not divisible by tp (2)",
        ),
        (["--checkpoint.keep_last", "0"], "checkpoint.keep_last (0) must be at least 1"),
        (["--train.eval_steps", "0"], "train.eval_steps (0) must be at least 1"),
        (
            [
                "--pp",
                "2",
                "--parallel.vpp",
                "2",
                "--train.eval_steps",
                "3",
                "--train.global_batch_size",
                "16",
                "--world-size",
                "2",
            ],
            "evaluates a multiple of pp (2) micro-batches, but train.eval_steps is 3",
        ),
        (["--train.min_lr", "0.1"], "train.min_lr (0.1) is above train.lr"),
        (["--train.beta2", "1.5"], "train.beta2 (1.5) must be in [0, 1)"),
        (["--train.eps", "0"], "train.eps (0.0) must be positive"),
        (["--train.wsd_decay_fraction", "2"], "train.wsd_decay_fraction (2.0) must be in [0, 1]"),
        (["--train.seed", "-1"], "train.seed (-1) must be a non-negative integer"),
        (
            ["--data.paths", "no/such/prefix"],
            "data.paths entry 'no/such/prefix' has no no/such/prefix.idx or no/such/prefix.bin",
        ),
        (
            [
                "--pp",
                "2",
                "--model.tie_embeddings",
                "true",
                "--parallel.overlap_param_gather",
                "true",
                "--world-size",
                "2",
            ],
            "parallel.overlap_param_gather with model.tie_embeddings at pp > 1 is not supported",
        ),
        (["--config", "missing.toml"], "config file 'missing.toml' does not exist"),
        (["--train.lr"], "setting --train.lr has no value"),
    ],
)
def test_bad_input_is_one_sentence(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([*args, "--dry-run"])  # bad input fails before any process or tensor
    err = capsys.readouterr().err
    assert code == 2
    assert message in err.replace("\n", " ")
    assert "Traceback" not in err


def test_bad_toml_is_one_sentence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nlr = 1")
    assert main(["--config", str(bad), "--dry-run"]) == 2
    assert "is not valid TOML" in capsys.readouterr().err


def test_dry_run_plans_8b_on_8_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--dry-run", "--model.size", "8b", "--tp", "2", "--pp", "2", "--world-size", "8",
                 "--train.seq_len", "8192", "--train.micro_batch_size", "1", "--train.global_batch_size", "64"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "8,030.3 M total" in out and "FLOPs per token" in out and "rank layout" in out
    assert "dp 2" in out


def test_preprocess_then_train_on_it(tmp_path: Path) -> None:
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(30))
    )
    done = _run(["preprocess", str(corpus), "--output", str(tmp_path / "data/docs")], tmp_path)
    assert done.returncode == 0, done.stderr
    done = _run(["--train.steps", "3", "--train.log_interval", "1", "--data.paths", str(tmp_path / "data/docs"),
                 "--run.name", "custom", "--run.tensorboard", "false"], tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [
        json.loads(x) for x in (tmp_path / "runs/custom/metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]


def test_bad_data_is_one_sentence(tmp_path: Path) -> None:
    corpus = tmp_path / "broken.jsonl"
    corpus.write_text('{"text": "fine"}\nnot json\n')
    done = _run(["preprocess", str(corpus), "--output", str(tmp_path / "out")], tmp_path)
    assert done.returncode == 2
    assert "line 2 of " in done.stderr and "broken.jsonl is not valid JSON" in done.stderr
    assert "Traceback" not in done.stderr


def test_default_command_runs_and_loss_falls(tmp_path: Path) -> None:
    """The README's first command, shortened: the tiny GPT on the stdlib corpus, on CPU."""
    done = _run(["--train.steps", "30", "--train.log_interval", "10"], tmp_path)
    assert done.returncode == 0, done.stderr
    run = tmp_path / "runs/tiny"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5  # from ~5.5 (uniform over 257)
    assert (run / "config.json").is_file() and (run / "checkpoints/latest").is_file()
    assert any((run / "tensorboard").iterdir())
    plot = _run(["plot", str(run), "--output", str(tmp_path / "c.png")], tmp_path)
    assert plot.returncode == 0 and (tmp_path / "c.png").stat().st_size > 1000
    latest = (run / "checkpoints/latest").read_text().strip()
    shown = _run(["inspect", str(run / "checkpoints" / latest), "--tensors"], tmp_path)
    assert shown.returncode == 0 and "layers.0.attention.qkv.weight" in shown.stdout


def test_hybrid_model_trains_from_the_cli(tmp_path: Path) -> None:
    """A Mamba + attention pattern from the command line (issue: `--model.pattern`)."""
    done = _run(["--model.size", "hybrid-tiny", "--model.pattern", "M*-M", "--train.steps", "3",
                 "--train.log_interval", "1", "--train.seq_len", "32", "--run.tensorboard", "false",
                 "--run.name", "hybrid"], tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [
        json.loads(x) for x in (tmp_path / "runs/hybrid/metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]
    bad = _run(
        ["--model.size", "hybrid-tiny", "--cp", "2", "--dry-run", "--world-size", "2"], tmp_path
    )
    assert bad.returncode == 2 and "not supported for hybrid (Mamba) models" in bad.stderr


@pytest.mark.parametrize("word", ["none", "null", "None"])
def test_optional_fields_unset_from_the_command_line(word: str) -> None:
    from mega_pretrain.config import load_config

    config = load_config(Path(__file__).parents[3] / "configs/8b.toml", [("parallel.vpp", word)])
    assert config.parallel.vpp is None  # the file sets vpp = 2


def test_too_small_validation_split_is_one_sentence(tmp_path: Path) -> None:
    corpus = tmp_path / "short.jsonl"  # 30 documents of ~22 byte tokens; 2 held out
    corpus.write_text(
        "".join(json.dumps({"text": f"document {i:02d} " * 2}) + "\n" for i in range(30))
    )
    done = _run(["preprocess", str(corpus), "--output", str(tmp_path / "data/short")], tmp_path)
    assert done.returncode == 0, done.stderr
    done = _run(["--train.steps", "1", "--data.paths", str(tmp_path / "data/short"),
                 "--data.valid_fraction", "0.05", "--run.tensorboard", "false"], tmp_path)  # fmt: skip
    assert done.returncode == 2
    assert "(data.valid_fraction 0.05) holds" in done.stderr
    assert "raise data.valid_fraction, or set it to 0" in done.stderr
    assert "Traceback" not in done.stderr
