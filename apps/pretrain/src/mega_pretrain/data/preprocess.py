"""Preprocessing: text, JSONL or folders of files -> one indexed token file pair.

A ``.txt``, ``.md`` or ``.py`` file is one document; a ``.jsonl`` file holds one JSON object per
line with the text in one field (``jsonl_key``); a ``.json`` file is read the same way, or, when
it starts with ``[``, as one array of such objects. Folders are searched recursively in sorted
order (hidden names skipped) for files with those suffixes.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from mega_pretrain.data.errors import DataError
from mega_pretrain.data.indexed import IndexedTokenWriter
from mega_pretrain.data.tokenizers import ByteTokenizer, Tokenizer, build_tokenizer

__all__ = ["JSON_SUFFIXES", "TEXT_SUFFIXES", "PreprocessStats", "find_input_files", "preprocess"]

#: Suffixes of files read whole as one document.
TEXT_SUFFIXES: tuple[str, ...] = (".txt", ".md", ".py")
#: Suffixes of files holding one JSON object per document.
JSON_SUFFIXES: tuple[str, ...] = (".jsonl", ".json")

_WAY_OUT = (
    "give .txt, .md or .py files (one document each), .jsonl or .json files "
    "(one document per line) or folders holding them"
)


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

    def __str__(self) -> str:
        """A summary for people, ending with the flag that trains on what was written."""
        rate = f"{self.tokens / self.seconds:,.0f}" if self.seconds > 0 else "-"
        skipped = f" ({self.skipped_empty:,} empty skipped)" if self.skipped_empty else ""
        files = f"{self.files:,} file{'s' if self.files != 1 else ''}"
        return (
            f"wrote {self.documents:,} documents{skipped}, {self.tokens:,} tokens from {files} "
            f"({self.bytes:,} bytes) in {self.seconds:.1f} s ({rate} tokens/s) to "
            f"{self.output_prefix}.bin and .idx; train on it with --data.paths {self.output_prefix}"
        )


def _describe(inputs: Sequence[Path]) -> str:
    names = ", ".join(str(p) for p in inputs[:3])
    return names + (f" and {len(inputs) - 3} more" if len(inputs) > 3 else "")


def find_input_files(inputs: str | Path | Sequence[str | Path]) -> list[Path]:
    """The files ``inputs`` name, folders expanded recursively in sorted order."""
    items = [Path(inputs)] if isinstance(inputs, str | Path) else [Path(p) for p in inputs]
    suffixes = TEXT_SUFFIXES + JSON_SUFFIXES
    files: list[Path] = []
    for item in items:
        if item.is_dir():
            found = [
                p
                for p in item.rglob("*")
                if p.suffix.lower() in suffixes
                and p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(item).parts)
            ]
            files.extend(sorted(found, key=lambda p: p.relative_to(item).parts))
        elif item.is_file():
            if item.suffix.lower() not in suffixes:
                raise DataError(
                    f"cannot tell the type of {item} from its suffix {item.suffix!r}; "
                    f"use {', '.join(TEXT_SUFFIXES)} (one document per file) or "
                    f"{', '.join(JSON_SUFFIXES)} (one document per line)"
                )
            files.append(item)
        else:
            raise DataError(f"input {item} does not exist; check the path")
    return files


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _text_field(obj: Any, key: str, where: str) -> str:
    if not isinstance(obj, dict):
        raise DataError(
            f"{where} is a JSON {_json_type(obj)}, not an object with a field {key!r}; "
            "write one JSON object per document"
        )
    if key not in obj:
        names = [repr(k) for k in list(obj)[:10]] + (["..."] if len(obj) > 10 else [])
        raise DataError(
            f"{where} has no field {key!r}; its fields are {', '.join(names) or '(none)'}; "
            "name the field that holds the text with --jsonl-key (jsonl_key= in Python)"
        )
    value = obj[key]
    if not isinstance(value, str):
        raise DataError(f"{where} holds a JSON {_json_type(value)} in {key!r}, not a string")
    return value


def _json_documents(path: Path, key: str) -> Iterator[tuple[str | None, int]]:
    """(text or None, bytes read since the previous document) for each document of a JSON file."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if path.suffix.lower() == ".json" and head.startswith(b"["):
        data = path.read_bytes()
        try:
            items = json.loads(data)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
            ) from None
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{path} is not valid UTF-8 ({exc.reason} at byte {exc.start})"
            ) from None
        if not items:
            yield None, len(data)
        for number, obj in enumerate(items, start=1):
            yield _text_field(obj, key, f"item {number} of {path}"), len(data) if number == 1 else 0
        return
    pending = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            pending += len(line)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"line {number} of {path} is not valid JSON: {exc.msg} (column {exc.colno})"
                ) from None
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"line {number} of {path} is not valid UTF-8 ({exc.reason} at byte {exc.start})"
                ) from None
            yield _text_field(obj, key, f"line {number} of {path}"), pending
            pending = 0
    if pending:
        yield None, pending  # trailing blank lines: bytes read, no document


def _documents(path: Path, key: str) -> Iterator[tuple[str | None, int]]:
    """(text or None, bytes read since the previous document) for each document of ``path``."""
    if path.suffix.lower() in JSON_SUFFIXES:
        yield from _json_documents(path, key)
        return
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path} is not valid UTF-8 text ({exc.reason} at byte {exc.start}); convert it to UTF-8"
        ) from None
    yield text, len(data)


@contextmanager
def _progress(enabled: bool, total_bytes: int) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar over the input bytes; yields ``advance(nbytes, documents)``."""
    if not enabled:
        yield lambda nbytes, documents: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("preprocess"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[documents]} documents"),
    )
    with Progress(*columns) as bar:
        task = bar.add_task("preprocess", total=total_bytes, documents=0)
        yield lambda nbytes, documents: bar.update(task, advance=nbytes, documents=documents)


def _encode(tokenizer: Tokenizer, text: str) -> npt.NDArray[Any]:
    if isinstance(tokenizer, ByteTokenizer):  # fast path: the bytes are the ids
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


def preprocess(
    inputs: str | Path | Sequence[str | Path],
    output_prefix: str | Path,
    tokenizer: Tokenizer | str = "byte",
    *,
    jsonl_key: str = "text",
    append_eod: bool = True,
    progress: bool = True,
) -> PreprocessStats:
    """Tokenize ``inputs`` into ``<output_prefix>.bin`` / ``<output_prefix>.idx``.

    ``tokenizer`` is a :class:`Tokenizer` or a spec for :func:`build_tokenizer` (``"byte"``,
    ``"hf:PATH"``, ``"tiktoken:PATH"``). With ``append_eod`` each stored document ends with the
    tokenizer's ``eod_id``, which is what separates documents once they are concatenated into
    samples. Empty documents are skipped, with one warning giving their number. The pair is
    written atomically: an error leaves any earlier pair at the prefix untouched. Bad input
    raises :class:`DataError` in one sentence naming the file and line.

    >>> stats = preprocess("corpus/", "data/corpus", "byte", progress=False)  # doctest: +SKIP
    """
    started = time.perf_counter()
    if isinstance(tokenizer, str):
        tokenizer = build_tokenizer(tokenizer)
    items = [Path(inputs)] if isinstance(inputs, str | Path) else [Path(p) for p in inputs]
    files = find_input_files(items)
    if not files:
        raise DataError(f"no documents found in {_describe(items) or 'no inputs'}; {_WAY_OUT}")
    total_bytes = sum(p.stat().st_size for p in files)
    eod = np.asarray([tokenizer.eod_id], dtype=np.int64)
    documents = skipped = read = 0
    with (
        IndexedTokenWriter(
            output_prefix, tokenizer.vocab_size, eod_id=tokenizer.eod_id if append_eod else None
        ) as writer,
        _progress(progress, total_bytes) as advance,
    ):
        for path in files:
            for text, nbytes in _documents(path, jsonl_key):
                read += nbytes
                if text is not None:
                    ids = _encode(tokenizer, text)
                    if ids.size:
                        writer.add_document(np.concatenate([ids, eod]) if append_eod else ids)
                        documents += 1
                    else:
                        skipped += 1
                advance(nbytes, documents)
        if documents == 0:
            empty = f" (all {skipped} were empty)" if skipped else ""
            raise DataError(f"no documents found in {_describe(items)}{empty}; {_WAY_OUT}")
        tokens = writer.num_tokens
    if skipped:
        warnings.warn(
            f"skipped {skipped} empty documents in {_describe(items)}", UserWarning, stacklevel=2
        )
    return PreprocessStats(
        output_prefix=Path(output_prefix),
        files=len(files),
        documents=documents,
        tokens=tokens,
        bytes=read,
        seconds=time.perf_counter() - started,
        skipped_empty=skipped,
    )
