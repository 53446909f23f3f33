"""Every device suite of ``bench/run.py`` names config keys, values and sizes that exist.

A device call is scarce (30 minutes a session, most of it often spent waiting for a
machine); a misspelt ``--set`` key or size fails its line only on the GPU, after the call's
start-up. This reads every command of every suite, without running it: the trainer's and
``bench/mega_step.py``'s config overrides (``--set KEY=VALUE``, ``--size``, ``--model.size``
and the like) go through the trainer's own ``load_config``, and each size through the model
registry.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path
from types import ModuleType

import pytest

from mega_pretrain.config import load_config
from mega_pretrain.plan import resolve_model_config

ROOT = Path(__file__).resolve().parent.parent
#: scripts that take bench/mega_step.py's arguments (they patch a part in, then run it)
STEP_SCRIPTS = {
    "bench/mega_step.py",
    "bench/fp8_expert_parts.py",
    "bench/fp8_delayed_parts.py",
    "bench/mla_padded.py",
    "bench/fp8_fixed_scale.py",
    "bench/wgrad_blocks.py",
    "bench/routing_parts.py",
}


def _bench_module(script: str) -> ModuleType:
    """``bench/<script>.py`` loaded as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"bench_{script}", ROOT / "bench" / f"{script}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _commands() -> list[tuple[str, str]]:
    suites: dict[str, list[tuple[str, int, str]]] = _bench_module("run").SUITES
    return [
        (f"{name}: {label}", command)
        for name, suite in suites.items()
        for label, _, command in suite
    ]


def _segments(command: str) -> list[list[str]]:
    """The command's simple commands as argument lists, environment assignments dropped."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|", "(", ")", ">", "<", "2>&1"):
            out.append([])
        else:
            out[-1].append(token)
    for words in out:
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words.pop(0)
    return [words for words in out if words]


def _step_overrides(args: list[str]) -> list[tuple[str, str]]:
    pairs = [("model.size", "1b-bench")]
    for i, word in enumerate(args):
        if word == "--set":
            key, sep, value = args[i + 1].partition("=")
            assert sep, f"--set {args[i + 1]!r} is not KEY=VALUE"
            pairs.append((key, value))
        elif word == "--size":
            pairs.append(("model.size", args[i + 1]))
    return pairs


def _trainer_overrides(args: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for i, word in enumerate(args):
        if word.startswith("--") and "." in word and i + 1 < len(args):
            if not args[i + 1].startswith("$"):
                pairs.append((word[2:], args[i + 1]))
    return pairs


def _overrides(command: str) -> list[list[tuple[str, str]]]:
    found = []
    for words in _segments(command):
        if words[0] != "python3":
            continue
        if len(words) > 1 and words[1] in STEP_SCRIPTS:
            found.append(_step_overrides(words[2:]))
        elif words[1:3] == ["-m", "mega_pretrain"]:
            found.append(_trainer_overrides(words[3:]))
    return found


COMMANDS = _commands()


def test_the_suites_were_read() -> None:
    with_config = [c for _, c in COMMANDS if _overrides(c)]
    assert len(with_config) > 100, len(with_config)  # the history of every session's calls


@pytest.mark.parametrize(("label", "command"), COMMANDS, ids=[label for label, _ in COMMANDS])
def test_every_override_and_size_exists(label: str, command: str) -> None:
    for pairs in _overrides(command):
        config = load_config(None, pairs)
        resolve_model_config(config)  # the size is one the registry knows


def test_wgrad_blocks_are_tested_configurations() -> None:
    """Every ``bench/wgrad_blocks.py --blocks`` of a suite parses to a configuration of the
    kernel's ``TUNING`` list, each of which its interpreter test runs (so no untested blocks
    reach the device), or is ``best``, which picks among the timed ones; a malformed one is
    one sentence, and so is ``best`` with nothing timed on every GEMM."""
    pytest.importorskip("triton")
    from mega_moe._wgrad_triton import TUNING

    module = _bench_module("wgrad_blocks")
    found = [
        words[words.index("--blocks") + 1]
        for _, command in COMMANDS
        for words in _segments(command)
        if "bench/wgrad_blocks.py" in words
    ]
    assert found
    for text in found:
        assert text == "best" or module.parse_blocks(text) in TUNING, text
    with pytest.raises(SystemExit, match="six integers"):
        module.parse_blocks("32,128")
    rows = [
        {"gemm": g, "blocks": list(b), "ms": ms}
        for g, b, ms in [("fc1", TUNING[0], 1.0), ("fc2", TUNING[0], 0.5),
                         ("fc1", TUNING[-1], 0.7), ("fc2", TUNING[-1], 0.6),
                         ("fc1", TUNING[1], 0.1)]  # timed on fc1 only: not a candidate
    ] + [{"gemm": "fc1", "blocks": None, "ms": 0.01}]  # fmt: skip
    assert module.best_blocks(rows) == TUNING[-1]
    with pytest.raises(SystemExit, match="times no configuration on every GEMM"):
        module.best_blocks([*rows[4:], {"gemm": "fc2", "blocks": None, "ms": 0.2}])
