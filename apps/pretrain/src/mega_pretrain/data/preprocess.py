"""Preprocessing: text, JSONL, parquet or arrow files, or folders of them -> one indexed token
file pair, tokenized by N worker processes into shards that a stopped run resumes from.

The inputs (see :mod:`mega_pretrain.data.sources`) are cut into pieces, and consecutive pieces
into shards of about ``shard_bytes`` of input, from the files alone: the shards, and so the
tokens written, are the same for any number of workers. Each shard is written atomically to
``<prefix>.shards/``; a run that was stopped (Ctrl-C, a kill, a lost node) keeps its complete
shards, and the same command run again writes only the rest. When all are written they are
concatenated, in input order, into ``<prefix>.bin`` / ``<prefix>.idx`` (one shard is renamed)
and the shard folder is removed. Bad input (a missing field, a line that is not JSON) is one
sentence and leaves no shards: the input has to change before a run can succeed.

    mega-pretrain preprocess data/ --output data/corpus --tokenizer hf:tok.json --workers 8
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mega_pretrain.data.errors import DataError
from mega_pretrain.data.indexed import IndexedTokenDataset, IndexedTokenWriter
from mega_pretrain.data.parallel import run_shards
from mega_pretrain.data.progress import ProgressLine
from mega_pretrain.data.shards import ShardJob, ShardResult, completed_shard, shard_prefix
from mega_pretrain.data.sources import (
    JSON_SUFFIXES,
    TABLE_SUFFIXES,
    TEXT_SUFFIXES,
    Piece,
    find_input_files,
    plan_pieces,
)
from mega_pretrain.data.tokenizers import Tokenizer, build_tokenizer

__all__ = [
    "JSON_SUFFIXES",
    "TABLE_SUFFIXES",
    "TEXT_SUFFIXES",
    "PreprocessStats",
    "find_input_files",
    "preprocess",
]

_WAY_OUT = (
    "give .txt, .md or .py files (one document each), .jsonl or .json files "
    "(one document per line, plain or .gz/.bz2/.xz/.zst compressed), .parquet or .arrow "
    "files (one document per row) or folders holding them"
)
_PLAN_VERSION = 1


@dataclass(frozen=True)
class PreprocessStats:
    """What one :func:`preprocess` call wrote."""

    output_prefix: Path
    """The prefix of the ``.bin`` / ``.idx`` pair written."""
    files: int
    """Input files read."""
    documents: int
    """Documents written (empty ones are skipped and counted apart)."""
    tokens: int
    """Tokens written, end-of-document tokens included."""
    bytes: int
    """Bytes of input read."""
    seconds: float
    """Wall-clock time of the whole call."""
    skipped_empty: int = 0
    """Empty documents skipped."""
    shards: int = 1
    """Shards the input was cut into (merged into the one pair)."""
    resumed: int = 0
    """Shards kept from an earlier run that was stopped, not tokenized again."""
    workers: int = 1
    """Worker processes that tokenized the shards."""

    def __str__(self) -> str:
        """A summary for people, ending with the flag that trains on what was written."""
        rate = f"{self.tokens / self.seconds:,.0f}" if self.seconds > 0 else "-"
        skipped = f" ({self.skipped_empty:,} empty skipped)" if self.skipped_empty else ""
        files = f"{self.files:,} file{'s' if self.files != 1 else ''}"
        shards = f"{self.shards:,} shard{'s' if self.shards != 1 else ''}"
        resumed = f", {self.resumed:,} kept from the stopped run" if self.resumed else ""
        return (
            f"wrote {self.documents:,} documents{skipped}, {self.tokens:,} tokens from {files} "
            f"({self.bytes:,} bytes; {shards}{resumed}, {self.workers} worker"
            f"{'s' if self.workers != 1 else ''}) in {self.seconds:.1f} s ({rate} tokens/s) to "
            f"{self.output_prefix}.bin and .idx; train on it with --data.paths {self.output_prefix}"
        )


def _describe(inputs: Sequence[Path]) -> str:
    names = ", ".join(str(p) for p in inputs[:3])
    return names + (f" and {len(inputs) - 3} more" if len(inputs) > 3 else "")


def _tokenizer_identity(tokenizer: Tokenizer) -> str:
    """What the shards' tokens depend on: the tokenizer's type, repr and file contents."""
    kind = type(tokenizer)
    identity = f"{kind.__module__}.{kind.__qualname__} {tokenizer!r} {tokenizer.vocab_size}"
    path = getattr(tokenizer, "path", None)
    if isinstance(path, Path) and path.is_file():
        identity += " " + hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()
    return f"{identity} eod {tokenizer.eod_id}"


def _group_shards(pieces: Sequence[Piece], shard_bytes: int) -> list[list[Piece]]:
    """Consecutive pieces grouped up to ``shard_bytes`` of input each (at least one piece)."""
    shards: list[list[Piece]] = []
    size = 0
    for piece in pieces:
        if not shards or size + piece.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(piece)
        size += piece.nbytes
    return shards


def _prepare_folder(folder: Path, plan: dict[str, Any]) -> None:
    """Keep ``folder``'s shards when they were written for this exact plan, else start it anew;
    remove what a stopped run left half-written."""
    manifest = folder / "plan.json"
    if folder.is_dir():
        try:
            same = json.loads(manifest.read_text()) == plan
        except (OSError, ValueError):
            same = False
        if not same:
            shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.tmp-*"):
        stale.unlink(missing_ok=True)
    if not manifest.is_file():
        temp = folder / f"plan.json.tmp-{os.getpid()}"
        temp.write_text(json.dumps(plan))
        os.replace(temp, manifest)


def _merge(folder: Path, results: dict[int, ShardResult], output_prefix: Path) -> None:
    """The shards, in order, as one pair at ``output_prefix`` (atomically); one is renamed."""
    indices = [i for i in sorted(results) if results[i].documents]
    output_prefix.parent.mkdir(parents=True, exist_ok=True)
    if len(indices) == 1:
        shard = shard_prefix(folder, indices[0])
        for suffix in (".bin", ".idx"):  # .bin first, as the writer does
            os.replace(
                shard.with_name(shard.name + suffix),
                output_prefix.with_name(output_prefix.name + suffix),
            )
        return
    first = IndexedTokenDataset(shard_prefix(folder, indices[0]))
    vocab = first.vocab_size
    assert vocab is not None
    with IndexedTokenWriter(output_prefix, vocab, eod_id=first.eod_id) as writer:
        for index in indices:
            writer.add_indexed(IndexedTokenDataset(shard_prefix(folder, index)))


def preprocess(
    inputs: str | Path | Sequence[str | Path],
    output_prefix: str | Path,
    tokenizer: Tokenizer | str = "byte",
    *,
    jsonl_key: str = "text",
    append_eod: bool = True,
    progress: bool = True,
    workers: int = 1,
    shard_bytes: int | None = None,
) -> PreprocessStats:
    """Tokenize ``inputs`` into ``<output_prefix>.bin`` / ``<output_prefix>.idx``.

    ``tokenizer`` is a :class:`Tokenizer` or a spec for :func:`build_tokenizer` (``"byte"``,
    ``"hf:PATH"``, ``"tiktoken:PATH"``). ``jsonl_key`` names the JSON field or the parquet/arrow
    column holding the text. With ``append_eod`` each stored document ends with the
    tokenizer's ``eod_id``, which is what separates documents once they are concatenated into
    samples. Empty documents are skipped, with one warning giving their number. ``workers``
    processes tokenize shards of about ``shard_bytes`` of input each (by default a 64th of the
    input, within 1–64 MiB); the output does not depend on ``workers`` (nor on the shards). ``progress`` writes a throttled progress line to stderr. The pair
    is written atomically: an error leaves any earlier pair at the prefix untouched. Bad input
    raises :class:`DataError` in one sentence naming the file and line.

    >>> stats = preprocess("corpus/", "data/corpus", "byte", workers=4)  # doctest: +SKIP
    """
    started = time.perf_counter()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers ({workers!r}) must be a whole number of processes, 1 or more")
    if shard_bytes is not None and (not isinstance(shard_bytes, int) or shard_bytes < 1):
        raise ValueError(f"shard_bytes ({shard_bytes!r}) must be a positive number of bytes")
    if isinstance(tokenizer, str):
        tokenizer = build_tokenizer(tokenizer)
    items = [Path(inputs)] if isinstance(inputs, str | Path) else [Path(p) for p in inputs]
    files = find_input_files(items)
    if not files:
        raise DataError(f"no documents found in {_describe(items) or 'no inputs'}; {_WAY_OUT}")
    if shard_bytes is None:
        total = sum(p.stat().st_size for p in files)
        shard_bytes = min(max(total // 64, 1 << 20), 64 << 20)
    shards = _group_shards(plan_pieces(files, shard_bytes), shard_bytes)
    output_prefix = Path(output_prefix)
    folder = output_prefix.with_name(output_prefix.name + ".shards")
    plan = {
        "version": _PLAN_VERSION,
        "tokenizer": _tokenizer_identity(tokenizer),
        "key": jsonl_key,
        "append_eod": append_eod,
        "inputs": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
        "shards": [[[p.path, p.start, p.stop] for p in shard] for shard in shards],
    }
    try:
        _prepare_folder(folder, plan)
        results = {i: r for i in range(len(shards)) if (r := completed_shard(folder, i))}
        todo = [(i, shard) for i, shard in enumerate(shards) if i not in results]
        pieces_left: dict[str, int] = {}
        for shard in shards:
            for piece in shard:
                pieces_left[piece.path] = pieces_left.get(piece.path, 0) + 1
        line = ProgressLine(len(files), len(shards), enabled=progress)

        def finished(index: int, result: ShardResult, *, resumed: bool = False) -> None:
            results[index] = result
            done_files = 0
            for piece in shards[index]:
                pieces_left[piece.path] -= 1
                done_files += pieces_left[piece.path] == 0
            line.advance(
                shards=1,
                files=done_files,
                documents=result.documents if resumed else 0,
                tokens=result.tokens if resumed else 0,
            )

        for index in list(results):
            finished(index, results[index], resumed=True)
        job = ShardJob(folder, tokenizer, jsonl_key, append_eod)
        try:
            run_shards(
                job, todo, workers, lambda d, t: line.advance(documents=d, tokens=t), finished
            )
        finally:
            line.close()
        documents = sum(r.documents for r in results.values())
        skipped = sum(r.skipped for r in results.values())
        if documents == 0:
            empty = f" (all {skipped} were empty)" if skipped else ""
            raise DataError(f"no documents found in {_describe(items)}{empty}; {_WAY_OUT}")
        _merge(folder, results, output_prefix)
    except (DataError, ImportError):  # the input must change first: nothing to resume
        shutil.rmtree(folder, ignore_errors=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    if skipped:
        warnings.warn(
            f"skipped {skipped} empty documents in {_describe(items)}", UserWarning, stacklevel=2
        )
    return PreprocessStats(
        output_prefix=output_prefix,
        files=len(files),
        documents=documents,
        tokens=sum(r.tokens for r in results.values()),
        bytes=sum(r.bytes for r in results.values()),
        seconds=time.perf_counter() - started,
        skipped_empty=skipped,
        shards=len(shards),
        resumed=len(shards) - len(todo),
        workers=min(workers, max(1, len(todo))),
    )
