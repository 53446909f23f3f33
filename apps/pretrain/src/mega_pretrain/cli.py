"""``mega-pretrain``: train (default), preprocess, inspect, plot, convert, config.

    uv run mega-pretrain                                   # tiny GPT on the stdlib corpus, CPU
    uv run mega-pretrain --config configs/125m.toml --train.lr 3e-4
    torchrun --nproc-per-node 8 -m mega_pretrain --config configs/8b.toml --tp 2 --pp 2
    uv run mega-pretrain --dry-run --model.size 8b --tp 2 --pp 2   # plan only, no processes
    uv run mega-pretrain preprocess corpus.jsonl --output data/corpus --tokenizer byte
    uv run mega-pretrain inspect runs/tiny/checkpoints/step_00000300
    uv run mega-pretrain plot runs/tiny runs/other --output curves.png
    uv run mega-pretrain convert --from-hf llama-dir --to runs/llama [--tp 2 ...]
    uv run mega-pretrain convert --to-hf out-dir --from runs/llama
    uv run mega-pretrain config --model.size 1b > my.toml    # every setting, as TOML
    uv run mega-pretrain --help                             # commands and every setting
    uv run mega-pretrain --version

Every setting of the config can be given as ``--section.field value``; ``--tp/--pp/--cp/
--ep/--etp/--vpp`` are shortcuts for ``--parallel.*``. Output goes to rank 0 only.

The command line is the standard library's: ``argparse`` for each command's own flags,
``difflib`` for "did you mean" on a mistyped command or setting, and the settings' help and
``config``'s TOML generated from the config dataclasses' field docstrings (``config_doc``).
A CLI framework (click, typer) would add a dependency and a second description of the same
fields; the dataclasses stay the only one. Help is plain text, one block per field and never
re-wrapped, so it reads the same on a terminal, in a pipe and in a Slurm log.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rich.console import Console

from mega_pretrain.errors import TrainingError

if TYPE_CHECKING:
    from mega_pretrain.config import TrainerConfig

__all__ = ["main"]

#: Each command and its line in ``--help``.
_COMMANDS = {
    "train": "train a model from a config file and --SECTION.FIELD settings (the default)",
    "preprocess": "tokenize text, JSONL, parquet or arrow files into PREFIX.bin/.idx",
    "inspect": "summarise a checkpoint (step, layout, files; --tensors: every tensor)",
    "plot": "draw the loss curves of run folders into a PNG",
    "convert": "import a Hugging Face checkpoint into a run folder, or export one to it",
    "config": "print every setting with its value and doc as TOML, to start a config file",
}

_PACKAGES = ("mega-pretrain", "mega-models", "mega-moe", "mega-tp-layers", "mega-pipeline",
             "mega-zero-optim", "mega-parallel-grid", "torch")  # fmt: skip


def _version_text() -> str:
    from importlib.metadata import PackageNotFoundError, version

    lines = []
    for name in _PACKAGES:
        try:
            lines.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            lines.append(f"{name} (not installed)")
    return "\n  ".join(lines) + f"\n  python {sys.version.split()[0]}"


def _split_overrides(rest: Sequence[str], options: Sequence[str] = ()) -> list[tuple[str, str]]:
    """``--section.field value`` pairs, each name checked (a typo names the nearest setting)."""
    from mega_pretrain.config_doc import check_setting

    pairs: list[tuple[str, str]] = []
    items = list(rest)
    i = 0
    while i < len(items):
        item = items[i]
        if not item.startswith("--") or len(item) == 2:
            raise ValueError(f"unexpected argument {item!r}; settings look like --train.lr 3e-4")
        key, has_value, value = item[2:].partition("=")
        check_setting(_normal(key), options)
        if has_value:
            i += 1
        else:
            if i + 1 >= len(items):
                raise ValueError(f"setting --{key} has no value; write --{key} VALUE")
            value = items[i + 1]
            i += 2
        pairs.append((_normal(key), value))
    return pairs


def _normal(key: str) -> str:
    return key.replace("-", "_") if "." not in key else key


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [o[2:] for a in parser._actions for o in a.option_strings if o.startswith("--")]


def _load(path: str | None, rest: Sequence[str], options: Sequence[str]) -> TrainerConfig:
    """``load_config`` after every name in the file and the overrides is checked."""
    import tomllib
    from pathlib import Path

    from mega_pretrain.config import load_config
    from mega_pretrain.config_doc import check_file_settings

    overrides = _split_overrides(rest, options)
    if path is not None and Path(path).is_file():
        try:
            tree = tomllib.loads(Path(path).read_text())
        except tomllib.TOMLDecodeError:
            tree = {}  # load_config says where the file is not valid TOML
        check_file_settings(tree, f" in {path}")
    return load_config(path, overrides)


def _train_parser(prog: str) -> argparse.ArgumentParser:
    from mega_pretrain.config_doc import SHORTCUTS, settings_help

    width = max(len(name) for name in _COMMANDS)
    commands = "\n".join(f"  {name:<{width}}  {line}" for name, line in _COMMANDS.items())
    shortcuts = "\n".join(f"  --{s:<4} N  = --parallel.{s} N" for s in SHORTCUTS)
    command = " [COMMAND]" if prog == "mega-pretrain" else ""
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog}{command} [--config FILE] [--dry-run] [--world-size N] "
        "[--SECTION.FIELD VALUE ...]",
        description=f"Pre-train a model (train is the default command).\n\ncommands (`mega-pretrain "
        f"COMMAND --help` for one):\n{commands}",
        epilog=f"shortcuts:\n{shortcuts}\n\n{settings_help()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", help="TOML config file; settings override it")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--world-size", metavar="N", type=int, default=None,
                        help="ranks to plan for (dry run)")  # fmt: skip
    parser.add_argument("--version", action="store_true",
                        help="the versions of mega-pretrain, the mega packages and torch")  # fmt: skip
    return parser


def _train(argv: Sequence[str], console: Console, prog: str = "mega-pretrain train") -> int:
    parser = _train_parser(prog)
    args, rest = parser.parse_known_args(argv)
    if args.version:
        print(_version_text())
        return 0
    config = _load(args.config, rest, _options(parser))
    if args.dry_run:
        from mega_pretrain.dry_run import dry_run
        from mega_pretrain.runtime import world_size_from_env

        world = args.world_size or world_size_from_env()
        p = config.parallel
        world = max(world, p.tp * p.pp * p.cp)
        console.print(dry_run(config, world), markup=False, highlight=False)
        return 0
    from mega_pretrain.train import train

    train(config, console=console)
    return 0


def _preprocess(argv: Sequence[str], console: Console) -> int:
    parser = argparse.ArgumentParser(prog="mega-pretrain preprocess")
    parser.add_argument(
        "inputs", nargs="+",
        help="text, JSONL (.gz/.bz2/.xz/.zst too), parquet or arrow files, or directories",
    )  # fmt: skip
    parser.add_argument("--output", required=True, help="output prefix (writes PREFIX.bin/.idx)")
    parser.add_argument("--tokenizer", default="byte", help="byte, hf:PATH or tiktoken:PATH")
    parser.add_argument(
        "--text-key", "--jsonl-key", dest="text_key", default="text",
        help="JSON field or parquet/arrow column holding the text",
    )  # fmt: skip
    parser.add_argument("--no-eod", action="store_true", help="do not end documents with EOD")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    parser.add_argument(
        "--shard-mb", type=float, default=None,
        help="input MiB per output shard (default: a 64th of the input, 1 to 64)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    shard = None if args.shard_mb is None else max(1, int(args.shard_mb * 2**20))
    from mega_pretrain.data import preprocess

    stats = preprocess(
        args.inputs, args.output, args.tokenizer, jsonl_key=args.text_key,
        append_eod=not args.no_eod, workers=args.workers, shard_bytes=shard,
    )  # fmt: skip
    console.print(str(stats), markup=False, highlight=False)
    return 0


def _inspect(argv: Sequence[str], console: Console) -> int:
    parser = argparse.ArgumentParser(prog="mega-pretrain inspect")
    parser.add_argument(
        "checkpoint",
        help="a checkpoint folder (runs/NAME/checkpoints/step_...), or a run or checkpoints "
        "folder (its latest)",
    )
    parser.add_argument(
        "--tensors", action="store_true", help="also the trainer state and every tensor"
    )
    args = parser.parse_args(argv)
    from pathlib import Path

    from mega_pretrain.checkpoint import inspect_checkpoint

    report = inspect_checkpoint(Path(args.checkpoint), tensors=args.tensors)
    console.print(report.text, markup=False, highlight=False)
    return 1 if report.damage else 0  # damaged files: the summary says which


def _plot(argv: Sequence[str], console: Console) -> int:
    parser = argparse.ArgumentParser(prog="mega-pretrain plot")
    parser.add_argument("runs", nargs="+", help="run folders holding metrics.jsonl")
    parser.add_argument("--output", default="curves.png", help="PNG file to write")
    args = parser.parse_args(argv)
    from mega_pretrain.plot import plot_runs

    console.print(f"wrote {plot_runs(args.runs, args.output)}")
    return 0


def _convert(argv: Sequence[str], console: Console) -> int:
    parser = argparse.ArgumentParser(prog="mega-pretrain convert")
    parser.add_argument("--from-hf", help="a Hugging Face model folder (config.json + safetensors)")
    parser.add_argument("--to", help="the run folder to create (with --from-hf)")
    parser.add_argument("--to-hf", help="the Hugging Face folder to write")
    parser.add_argument("--from", dest="source", help="a run folder or checkpoint (with --to-hf)")
    args, rest = parser.parse_known_args(argv)
    from pathlib import Path

    from mega_pretrain.convert import from_hf, to_hf

    overrides = _split_overrides(rest, _options(parser))
    if args.from_hf and args.to:
        console.print(f"wrote {from_hf(Path(args.from_hf), Path(args.to), overrides)}")
    elif args.to_hf and args.source:
        console.print(f"wrote {to_hf(Path(args.source), Path(args.to_hf), overrides)}")
    else:
        raise ValueError("convert needs --from-hf DIR --to RUN_DIR, or --to-hf DIR --from RUN_DIR")
    return 0


def _config(argv: Sequence[str], console: Console) -> int:
    parser = argparse.ArgumentParser(
        prog="mega-pretrain config",
        usage="mega-pretrain config [--config FILE] [--SECTION.FIELD VALUE ...]",
        description="Print every setting with its resolved value and doc as TOML (the model's "
        "own fields commented out, with model.size's values); `mega-pretrain --help` lists the "
        "settings.",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML config file; settings override it")
    args, rest = parser.parse_known_args(argv)
    from mega_pretrain.config_doc import config_toml

    print(config_toml(_load(args.config, rest, _options(parser))), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mega-pretrain`` command; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    console = Console(soft_wrap=True)  # one line per event, also in piped and Slurm logs
    if args and not args[0].startswith("-") and args[0] not in _COMMANDS:
        import difflib

        near = difflib.get_close_matches(args[0], list(_COMMANDS), n=1)
        hint = f"did you mean {near[0]!r}?" if near else f"the commands are {', '.join(_COMMANDS)}"
        if args[0].endswith(".toml"):  # a config file given without --config
            hint = f"to train from a config file, write --config {args[0]}"
        print(f"error: unknown command {args[0]!r}; {hint}", file=sys.stderr)
        return 2
    handlers: dict[str, Callable[[Sequence[str], Console], int]] = {
        "train": _train, "preprocess": _preprocess, "inspect": _inspect, "plot": _plot,
        "convert": _convert, "config": _config,
    }  # fmt: skip
    try:
        if args and args[0] in _COMMANDS:
            return handlers[args[0]](args[1:], console)
        return _train(args, console, prog="mega-pretrain")  # the default command
    except SystemExit as exc:  # argparse's --help (0) and usage errors (2)
        if isinstance(exc.code, int) or exc.code is None:
            return exc.code or 0
        print(f"error: {exc.code}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, ImportError) as exc:  # user errors: one sentence
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrainingError as exc:  # a run that cannot go on (non-finite loss): one sentence
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
