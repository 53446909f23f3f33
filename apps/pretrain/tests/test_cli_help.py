"""What the command says about itself: --help from the field docstrings, --version, ``config``
as TOML that loads back to the same config, and "did you mean" for a mistyped name.

The expected names come from ``dataclasses.fields`` of the config classes, so a field added to
``mega_pretrain.config`` is expected in the help without an edit here.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tomllib
import typing
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from mega_pretrain.cli import main
from mega_pretrain.config import TrainerConfig, load_config
from mega_pretrain.config_doc import field_docs, first_sentence

_CONFIGS = Path(__file__).parents[3] / "configs"
_COMMANDS = ("train", "preprocess", "inspect", "plot", "convert", "config")


def _sections() -> list[tuple[str, type[Any]]]:
    hints = typing.get_type_hints(TrainerConfig)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(TrainerConfig)]


def _settings() -> list[tuple[str, dataclasses.Field[Any], type[Any]]]:
    return [(s, f, cls) for s, cls in _sections() for f in dataclasses.fields(cls)]


def _help(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main([*args, "--help"]) == 0
    return capsys.readouterr().out


def test_help_lists_every_field_of_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(capsys)
    lines = out.splitlines()
    for section, _ in _sections():
        assert any(line.startswith(f"[{section}]  ") for line in lines), section
    for section, f, cls in _settings():
        if typing.get_origin(typing.get_type_hints(cls)[f.name]) is dict:  # model.overrides
            assert f"--{section}.NAME VALUE  ({section}.{f.name}: " in out
            continue
        i = next(i for i, line in enumerate(lines) if line.startswith(f"  --{section}.{f.name} "))
        assert " = " in lines[i]  # type and default on the name's line
        doc = field_docs(cls)[f.name]
        assert lines[i + 1] == f"      {first_sentence(doc)}"  # the doc, one unwrapped line
    for short in ("tp", "pp", "cp", "ep", "etp", "vpp"):
        assert f"--{short:<4} N  = --parallel.{short} N" in out
        assert f"--parallel.{short} " in out and f"(or --{short})" in out
    for command in _COMMANDS:
        assert any(line.startswith(f"  {command} ") and len(line) > 30 for line in lines), command
    assert "--version" in out and "--dry-run" in out and "--config FILE" in out


def test_train_help_is_the_same_settings(capsys: pytest.CaptureFixture[str]) -> None:
    root = _help(capsys)
    train = _help(capsys, "train")
    assert train.startswith("usage: mega-pretrain train ")
    assert root[root.index("shortcuts:") :] == train[train.index("shortcuts:") :]


def test_help_is_not_rewrapped_for_a_narrow_pipe(tmp_path: Path) -> None:
    def settings(columns: str) -> str:
        env = {**os.environ, "COLUMNS": columns}
        done = subprocess.run([sys.executable, "-m", "mega_pretrain", "--help"], env=env,
                              text=True, capture_output=True, check=True, timeout=120)  # fmt: skip
        return done.stdout[done.stdout.index("shortcuts:") :]

    narrow = settings("40")
    assert narrow == settings("300")
    assert "\n  --parallel.tp_comm_overlap true|false = false\n      Overlap the " in narrow


@pytest.mark.parametrize("command", _COMMANDS)
def test_each_subcommand_has_its_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(capsys, command)
    assert out.startswith(f"usage: mega-pretrain {command} ")


def test_version_lists_the_packages(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"mega-pretrain {version('mega-pretrain')}"
    for name in ("mega-models", "mega-moe", "mega-tp-layers", "mega-pipeline", "mega-zero-optim",
                 "mega-parallel-grid", "torch"):  # fmt: skip
        assert f"  {name} {version(name)}" in lines


@pytest.mark.parametrize(
    ("config", "overrides"),
    [
        (None, []),
        ("8b.toml", ["--model.num_layers", "8", "--etp", "1", "--parallel.pp_layers", "5,3",
                     "--data.paths", "a/b,c", "--data.weights", "0.25,0.75",
                     "--run.peak_tflops", "989.5", "--run.name", 'say "hi"\\there',
                     "--train.eps", "1e-12", "--parallel.vpp", "none",
                     "--run.out_dir", "dé\x7fl\ttab"]),
        ("moe-tiny.toml", ["--model.moe_layer_pattern", "-E-E"]),
        ("hybrid-moe-tiny.toml", []),
    ],
    ids=["defaults", "8b-overridden", "moe", "hybrid"],
)  # fmt: skip
def test_config_prints_toml_that_loads_back_the_same(
    config: str | None, overrides: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file_args = [] if config is None else ["--config", str(_CONFIGS / config)]
    assert main(["config", *file_args, *overrides]) == 0
    text = capsys.readouterr().out
    tree = tomllib.loads(text)
    assert [s for s, _ in _sections()] == list(tree)  # every section, in order
    copy = tmp_path / "copy.toml"
    copy.write_text(text)
    pairs = list(zip(overrides[::2], overrides[1::2], strict=True))
    expected = load_config(None if config is None else _CONFIGS / config,
                           [(k[2:], v) for k, v in pairs])  # fmt: skip
    assert load_config(copy) == expected
    lines = text.splitlines()
    for _, f, cls in _settings():
        if typing.get_origin(typing.get_type_hints(cls)[f.name]) is dict:
            continue
        i = next(i for i, line in enumerate(lines) if line.startswith(f"{f.name} = "))
        doc_line = field_docs(cls)[f.name].replace("``", "`").splitlines()[-1].strip()
        assert doc_line in lines[i - 2] and lines[i - 1].startswith("# (")  # doc, type: above


def test_config_lists_the_models_fields_commented_out(capsys: pytest.CaptureFixture[str]) -> None:
    from mega_models import MODEL_SIZES

    assert main(["config", "--model.size", "8b", "--model.num_layers", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    size = MODEL_SIZES["8b"]
    assert "num_layers = 2" in lines
    assert f"# hidden_size = {size.hidden_size}" in lines
    assert "# Width of the residual stream." in lines


def test_field_docs_follow_the_source() -> None:
    @dataclass(frozen=True)
    class Added:
        """A section with a field added later."""

        old: int = 1
        """The old one."""
        new: str = "x"
        """The new one, over
        two lines."""
        bare: float = 0.0

    assert field_docs(Added) == {"old": "The old one.", "new": "The new one, over\ntwo lines."}
    assert first_sentence("Splits, e.g. ``13,11``. Second.") == "Splits, e.g. `13,11`."


def test_a_mistyped_command_names_the_nearest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inpsect", "runs/x"]) == 2
    assert capsys.readouterr().err == "error: unknown command 'inpsect'; did you mean 'inspect'?\n"
    assert main(["configs/8b.toml"]) == 2
    assert "write --config configs/8b.toml" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'; the commands are train, preprocess" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--train.lrr", "1e-3"], "unknown setting train.lrr; did you mean train.lr?"),
        (["--train.lrr=1e-3"], "unknown setting train.lrr; did you mean train.lr?"),
        (["--trian.lr", "1e-3"], "unknown setting trian.lr; did you mean train.lr?"),
        (["--lr", "1e-3"], "unknown setting lr; did you mean train.lr?"),
        (["--train.tp", "2"], "unknown setting train.tp; did you mean parallel.tp?"),
        (["--model.num_layer", "2"], "unknown setting model.num_layer; did you mean model.num_layers?"),
        (["--dry-runn"], "unknown option --dry-runn; did you mean --dry-run?"),
        (["config", "--run.nmae", "x"], "unknown setting run.nmae; did you mean run.name?"),
        (["--train.bogus", "1"], "unknown setting train.bogus; the settings of [train] are steps, "),
    ],
)  # fmt: skip
def test_a_mistyped_setting_names_the_nearest(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


def test_a_mistyped_setting_in_a_file_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "my.toml"
    config.write_text('[train]\nlrr = 1e-3\n[model]\nsize = "tiny"\nnum_layer = 2\n')
    assert main(["--config", str(config), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: unknown setting train.lrr in {config}; did you mean train.lr?\n"
    config.write_text("[model]\nnum_layer = 2\n")
    assert main(["config", "--config", str(config)]) == 2
    assert "unknown setting model.num_layer in " in capsys.readouterr().err
