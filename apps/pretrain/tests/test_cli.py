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
        (["--train.bogus", "1"], "unknown setting train.bogus; the settings of [train] are"),
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
        (
            ["--train.warmup_steps", "500", "--train.steps", "30"],
            "train.warmup_steps (500) exceeds train.steps (30)",
        ),
        (["--run.timeout_minutes", "0"], "run.timeout_minutes (0.0) must be positive"),
        (
            ["--model.size", "1b", "--model.pattern", "M*M-"],
            "model.pattern 'M*M-' has 4 layers but model.size 1b has 22; give a pattern of 22",
        ),
        (
            ["--model.pattern", "M*M-", "--model.num_layers", "6"],
            "model.pattern 'M*M-' has 4 layers but model.num_layers has 6",
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
    summary = done.stdout.strip()  # one line, however long the path (stdout is a pipe)
    assert "PreprocessStats(" not in summary and "\n" not in summary
    assert summary.startswith("wrote 30 documents, ") and " tokens from 1 file (" in summary
    assert summary.endswith(f"; train on it with --data.paths {tmp_path / 'data/docs'}")
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


def test_a_size_with_a_pattern_builds_that_sizes_hybrid() -> None:
    """`--model.size 1b --model.pattern ...` keeps 1b's dimensions (not hybrid-tiny's)."""
    from mega_models import HybridConfig
    from mega_pretrain.build import gpt_config
    from mega_pretrain.config import load_config

    pattern = "M*M-" * 5 + "M*"  # 22 letters: 1b's layer count
    model = gpt_config(load_config(None, [("model.size", "1b"), ("model.pattern", pattern)]))
    assert isinstance(model, HybridConfig) and model.pattern == pattern
    assert (model.hidden_size, model.num_attention_heads, model.num_layers) == (2048, 16, 22)
    assert (model.vocab_size, model.ffn_hidden_size, model.kv_heads) == (32000, 5632, 4)
    assert model.mamba_head_dim == 64  # hybrid-1b's Mamba settings: the same width
    short = gpt_config(load_config(None, [("model.size", "1b"), ("model.pattern", "M*M-"),
                                          ("model.num_layers", "4")]))  # fmt: skip
    assert (short.hidden_size, short.num_layers) == (2048, 4)
    tiny = gpt_config(load_config(None, [("model.pattern", "M*M-M*M-")]))
    assert (tiny.hidden_size, tiny.num_layers) == (64, 8)


def test_dry_run_states_precision_and_timeout_in_unwrapped_lines(tmp_path: Path) -> None:
    """Off a terminal (stdout piped) a long line stays one line, not wrapped at 80 columns."""
    done = _run(["--dry-run", "--run.timeout_minutes", "3", "--run.device", "cpu"], tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    model = next(line for line in lines if line.startswith("model: tiny "))
    assert len(model) > 200 and model.rstrip().endswith(")")  # the whole GPTConfig repr
    assert "precision: fp32 (train.precision auto on cpu)" in lines
    assert "collective timeout: 3 min (run.timeout_minutes)" in lines
    assert (
        "schedule: 20 warm-up steps to lr 0.003, then cosine decay to 0.0003 by step 300" in lines
    )


def _token_file(prefix: Path, vocab: int, ids: list[int], header_vocab: int | None = None) -> None:
    from mega_pretrain.data import IndexedTokenWriter

    with IndexedTokenWriter(prefix, vocab_size=vocab) as writer:
        writer.add_document(ids)
    if header_vocab is not None:  # a header that understates the ids (another tool's file)
        idx = prefix.with_name(prefix.name + ".idx")
        raw = bytearray(idx.read_bytes())
        raw[16:24] = header_vocab.to_bytes(8, "little")
        idx.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("header_vocab", "message"),
    [
        (None, "was written for a vocabulary of 1000 tokens but the model has vocab_size 257; "
               "set --model.vocab_size to at least 1000"),
        (200, "holds token id 900, outside the model's vocab_size 257 (ids 0..256); "
              "set --model.vocab_size to at least 901"),
    ],
    ids=["header", "sampled-ids"],
)  # fmt: skip
def test_out_of_vocabulary_data_is_one_sentence_at_config_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], header_vocab: int | None, message: str
) -> None:
    prefix = tmp_path / "wide"
    _token_file(prefix, 1000, [5, 7, 900, 3] * 50, header_vocab)
    assert main(["--dry-run", "--data.paths", str(prefix)]) == 2
    err = capsys.readouterr().err
    assert f"the token file {prefix}.bin " in err and message in err
    assert "Traceback" not in err and err.count("\n") == 1
    fits = ["--dry-run", "--data.paths", str(prefix), "--model.vocab_size", "1024"]
    assert main(fits) == 0
