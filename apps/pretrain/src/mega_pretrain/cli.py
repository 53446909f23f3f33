"""``mega-pretrain``: train (default), preprocess, inspect, plot, convert.

    uv run mega-pretrain                                   # tiny GPT on the stdlib corpus, CPU
    uv run mega-pretrain --config configs/125m.toml --train.lr 3e-4
    torchrun --nproc-per-node 8 -m mega_pretrain --config configs/8b.toml --tp 2 --pp 2
    uv run mega-pretrain --dry-run --model.size 8b --tp 2 --pp 2   # plan only, no processes
    uv run mega-pretrain preprocess corpus.jsonl --output data/corpus --tokenizer byte
    uv run mega-pretrain inspect runs/tiny/checkpoints/step_00000300
    uv run mega-pretrain plot runs/tiny runs/other --output curves.png
    uv run mega-pretrain convert --from-hf llama-dir --to runs/llama [--tp 2 ...]
    uv run mega-pretrain convert --to-hf out-dir --from runs/llama

Every setting of the config can be given as ``--section.field value``; ``--tp/--pp/--cp/
--ep/--etp/--vpp`` are shortcuts for ``--parallel.*``. Output goes to rank 0 only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console

from mega_pretrain.errors import TrainingError

__all__ = ["main"]

_COMMANDS = ("train", "preprocess", "inspect", "plot", "convert")


def _split_overrides(rest: Sequence[str]) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    items = list(rest)
    i = 0
    while i < len(items):
        item = items[i]
        if not item.startswith("--") or len(item) == 2:
            raise ValueError(f"unexpected argument {item!r}; settings look like --train.lr 3e-4")
        key = item[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(items):
                raise ValueError(f"setting --{key} has no value; write --{key} VALUE")
            value = items[i + 1]
            i += 2
        pairs.append((key.replace("-", "_") if "." not in key else key, value))
    return pairs


def _train(argv: Sequence[str], console: Console) -> int:
    parser = argparse.ArgumentParser(prog="mega-pretrain train", add_help=True)
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--world-size", type=int, default=None, help="ranks to plan for (dry run)")
    args, rest = parser.parse_known_args(argv)
    from mega_pretrain.config import load_config

    config = load_config(args.config, _split_overrides(rest))
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
    parser.add_argument("inputs", nargs="+", help="text or JSONL files, or directories")
    parser.add_argument("--output", required=True, help="output prefix (writes PREFIX.bin/.idx)")
    parser.add_argument("--tokenizer", default="byte", help="byte, hf:PATH or tiktoken:PATH")
    parser.add_argument("--jsonl-key", default="text", help="field of each JSONL line")
    parser.add_argument("--no-eod", action="store_true", help="do not end documents with EOD")
    args = parser.parse_args(argv)
    from mega_pretrain.data import preprocess

    stats = preprocess(
        args.inputs, args.output, args.tokenizer, jsonl_key=args.jsonl_key,
        append_eod=not args.no_eod, progress=console.is_terminal,
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

    overrides = _split_overrides(rest)
    if args.from_hf and args.to:
        console.print(f"wrote {from_hf(Path(args.from_hf), Path(args.to), overrides)}")
    elif args.to_hf and args.source:
        console.print(f"wrote {to_hf(Path(args.source), Path(args.to_hf), overrides)}")
    else:
        raise ValueError("convert needs --from-hf DIR --to RUN_DIR, or --to-hf DIR --from RUN_DIR")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mega-pretrain`` command; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    console = Console(soft_wrap=True)  # one line per event, also in piped and Slurm logs
    command = "train"
    if args and args[0] in _COMMANDS:
        command = args.pop(0)
    handlers = {"train": _train, "preprocess": _preprocess, "inspect": _inspect, "plot": _plot,
                "convert": _convert}  # fmt: skip
    try:
        return handlers[command](args, console)
    except (ValueError, FileNotFoundError, ImportError) as exc:  # user errors: one sentence
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrainingError as exc:  # a run that cannot go on (non-finite loss): one sentence
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
