"""Input files for :func:`~mega_pretrain.data.preprocess`: what each one is, how it is cut into
pieces that workers can read independently, and the documents of one piece.

=================================  ======================  ==================================
input                              document                read with
=================================  ======================  ==================================
``.txt`` ``.md`` ``.py``           the whole file (UTF-8)  the standard library
``.jsonl`` ``.json``               one JSON object a line  the standard library, line by line
``... .gz`` ``.bz2`` ``.xz``       the same, compressed    ``gzip`` / ``bz2`` / ``lzma``
``... .zst``                       the same, compressed    pyarrow (extra ``hf-data``)
``.parquet``                       one row                 pyarrow, by row groups
``.arrow`` (IPC stream or file)    one row                 pyarrow, memory-mapped batches
=================================  ======================  ==================================

A ``.json`` file that starts with ``[`` is one array of objects, read whole. The text is the
field or column ``key`` (``--text-key``); a null cell is an empty document. Parquet and Arrow
inputs are read in record batches of the text column alone, never a whole file in memory, and
a plain JSONL file is cut at byte offsets (a line belongs to the piece holding its first byte),
so one large file is tokenized by several workers. The pieces depend on the files alone, never
on the number of workers.
"""

from __future__ import annotations

import bz2
import functools
import gzip
import importlib
import io
import itertools
import json
import lzma
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mega_pretrain.data.errors import DataError

__all__ = [
    "COMPRESSED_SUFFIXES",
    "JSON_SUFFIXES",
    "TABLE_SUFFIXES",
    "TEXT_SUFFIXES",
    "Piece",
    "file_kind",
    "find_input_files",
    "piece_documents",
    "plan_pieces",
]

#: Suffixes of files read whole as one document.
TEXT_SUFFIXES: tuple[str, ...] = (".txt", ".md", ".py")
#: Suffixes of files holding one JSON object per document.
JSON_SUFFIXES: tuple[str, ...] = (".jsonl", ".json")
#: Suffixes of compressed JSON files (after ``.jsonl`` or ``.json``).
COMPRESSED_SUFFIXES: tuple[str, ...] = (".gz", ".bz2", ".xz", ".zst")
#: Suffixes of columnar files holding one document per row (need the ``hf-data`` extra).
TABLE_SUFFIXES: tuple[str, ...] = (".parquet", ".arrow")

#: Names the ``datasets`` library writes beside its ``.arrow`` files: metadata, not documents.
_DATASETS_METADATA = frozenset({"dataset_info.json", "state.json", "dataset_dict.json"})
_BATCH_ROWS = 1024
_EXTRA = "pip install 'mega-pretrain[hf-data]'"


def file_kind(path: Path) -> str | None:
    """``"text"``, ``"json"``, ``"parquet"``, ``"arrow"``, or None for a suffix not read."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    if not suffixes:
        return None
    if suffixes[-1] in COMPRESSED_SUFFIXES:
        return "json" if len(suffixes) == 2 and suffixes[0] in JSON_SUFFIXES else None
    last = suffixes[-1]
    if last in TEXT_SUFFIXES:
        return "text"
    if last in JSON_SUFFIXES:
        return "json"
    return last[1:] if last in TABLE_SUFFIXES else None


def find_input_files(inputs: str | Path | Sequence[str | Path]) -> list[Path]:
    """The files ``inputs`` name, folders expanded recursively in sorted order.

    Hidden names are skipped, and so are other suffixes; a folder holding any ``.parquet`` or
    ``.arrow`` file is a dataset folder, of which only those files are read (its
    ``README.md`` and JSON metadata are not documents).
    """
    items = [Path(inputs)] if isinstance(inputs, str | Path) else [Path(p) for p in inputs]
    files: list[Path] = []
    for item in items:
        if item.is_dir():
            found = sorted(
                (
                    p
                    for p in item.rglob("*")
                    if file_kind(p) is not None
                    and p.name not in _DATASETS_METADATA
                    and p.is_file()
                    and not any(part.startswith(".") for part in p.relative_to(item).parts)
                ),
                key=lambda p: p.relative_to(item).parts,
            )
            tables = [p for p in found if file_kind(p) in ("parquet", "arrow")]
            files.extend(tables or found)
        elif item.is_file():
            if file_kind(item) is None:
                raise DataError(
                    f"cannot tell the type of {item} from its suffix {item.suffix!r}; "
                    f"use {', '.join(TEXT_SUFFIXES)} (one document per file), "
                    f"{', '.join(JSON_SUFFIXES)} (one document per line, plain or "
                    f"{'/'.join(COMPRESSED_SUFFIXES)} compressed) or "
                    f"{', '.join(TABLE_SUFFIXES)} (one document per row)"
                )
            files.append(item)
        else:
            raise DataError(f"input {item} does not exist; check the path")
    return files


@dataclass(frozen=True)
class Piece:
    """A part of one input file that one worker reads alone."""

    path: str
    kind: str
    """``"text"``, ``"json"``, ``"parquet"`` or ``"arrow"``."""
    start: int
    """First byte (plain JSONL), row group (parquet) or record batch (arrow); else 0."""
    stop: int
    """End (exclusive) in the same unit; -1 for the end of the file."""
    nbytes: int
    """Bytes of the input file counted for this piece (a file's pieces add up to its size)."""


def _pyarrow(path: Path) -> Any:
    try:
        return importlib.import_module("pyarrow")
    except ImportError:
        raise ImportError(
            f"reading {path} needs pyarrow, which is not installed; install it with `{_EXTRA}`"
        ) from None


def _split_sizes(path: Path, sizes: Sequence[int], target: int) -> list[Piece]:
    """Consecutive units (row groups, batches) of ``sizes`` grouped up to ``target`` bytes."""
    kind = file_kind(path)
    assert kind is not None
    total, file_size = max(1, sum(sizes)), path.stat().st_size
    bounds, run = [0], 0
    for i, size in enumerate(sizes):
        if run and run + size > target:
            bounds.append(i)
            run = 0
        run += size
    bounds.append(len(sizes))
    pieces, done, cum = [], 0, 0
    for a, b in itertools.pairwise(bounds):
        cum += sum(sizes[a:b])
        share = file_size if b == len(sizes) else file_size * cum // total
        pieces.append(Piece(str(path), kind, a, b, share - done))
        done = share
    return pieces


def _arrow_reader(pa: Any, source: Any) -> Any:
    """An IPC file reader when the data has the file format's magic, else a stream reader."""
    head = source.read(6)
    source.seek(0)
    return pa.ipc.open_file(source) if head == b"ARROW1" else pa.ipc.open_stream(source)


def _table_pieces(path: Path, kind: str, target: int) -> list[Piece]:
    pa = _pyarrow(path)
    try:
        if kind == "parquet":
            meta = importlib.import_module("pyarrow.parquet").ParquetFile(path).metadata
            sizes = [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]
        else:
            with pa.memory_map(str(path)) as source:
                reader = _arrow_reader(pa, source)
                if hasattr(reader, "num_record_batches"):
                    n = reader.num_record_batches
                    sizes = [reader.get_batch(i).nbytes for i in range(n)]
                else:
                    sizes = [batch.nbytes for batch in reader]
    except (pa.ArrowInvalid, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(
            f"cannot read {path} as {'Parquet' if kind == 'parquet' else 'Arrow IPC'} "
            f"({reason}); give a file written by pyarrow or the datasets library"
        ) from None
    if not sizes:
        return [Piece(str(path), kind, 0, 0, path.stat().st_size)]
    return _split_sizes(path, sizes, target)


def plan_pieces(files: Sequence[Path], target_bytes: int) -> list[Piece]:
    """Each file cut into pieces of about ``target_bytes`` where its format allows (plain
    JSONL by bytes, parquet by row groups, arrow by record batches; the rest whole)."""
    pieces: list[Piece] = []
    for path in files:
        kind = file_kind(path)
        assert kind is not None, path
        size = path.stat().st_size
        if kind in ("parquet", "arrow"):
            pieces.extend(_table_pieces(path, kind, target_bytes))
        elif kind == "json" and path.suffix.lower() == ".jsonl" and size > target_bytes:
            starts = range(0, size, target_bytes)
            pieces.extend(
                Piece(str(path), kind, s, min(s + target_bytes, size), min(target_bytes, size - s))
                for s in starts
            )
        else:
            pieces.append(Piece(str(path), kind, 0, -1, size))
    return pieces


# ----------------------------------------------------------------------------- reading


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


def _open_binary(path: Path) -> io.BufferedIOBase:
    """``path`` opened for reading bytes, decompressed as its suffix says."""
    suffix = path.suffix.lower()
    if suffix == ".gz":
        return gzip.open(path, "rb")
    if suffix == ".bz2":
        return bz2.open(path, "rb")
    if suffix == ".xz":
        return lzma.open(path, "rb")
    if suffix == ".zst":
        pa = _pyarrow(path)
        return io.BufferedReader(pa.input_stream(str(path), compression="zstd"), 1 << 20)
    return open(path, "rb")


def _newlines_before(path: Path, offset: int) -> int:
    """Number of line ends in the first ``offset`` bytes of a plain file (for error messages)."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            chunk = f.read(min(offset, 1 << 24))
            if not chunk:
                break
            count += chunk.count(b"\n")
            offset -= len(chunk)
    return count


def _parse_json(data: bytes, where: Callable[[], str], *, whole: bool) -> Any:
    """``json.loads(data)``; bad JSON or UTF-8 is one sentence naming ``where()``."""
    try:
        return json.loads(data)
    except json.JSONDecodeError as exc:
        at = f"line {exc.lineno}, column {exc.colno}" if whole else f"column {exc.colno}"
        raise DataError(f"{where()} is not valid JSON: {exc.msg} ({at})") from None
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{where()} is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None


def _json_array(path: Path, key: str) -> Iterator[list[str | None]]:
    with _open_binary(path) as f:
        data = f.read()
    items = _parse_json(data, lambda: str(path), whole=True)
    if not isinstance(items, list):
        raise DataError(f"{path} is a JSON {_json_type(items)}; give an array of objects")
    texts: list[str | None] = [
        _text_field(obj, key, f"item {number} of {path}")
        for number, obj in enumerate(items, start=1)
    ]
    for i in range(0, len(texts), _BATCH_ROWS):
        yield texts[i : i + _BATCH_ROWS]


def _json_lines(piece: Piece, key: str) -> Iterator[list[str | None]]:
    path = Path(piece.path)
    with _open_binary(path) as f:
        if piece.start > 0:
            f.seek(piece.start - 1)
            f.readline()  # the line holding byte start-1 belongs to the piece before
        first = f.tell() if piece.start > 0 else 0
        pos = first

        def where(relative: int) -> str:  # "line N of PATH", counted only on error
            base = _newlines_before(path, first) if first > 0 else 0
            return f"line {base + relative + 1} of {path}"

        batch: list[str | None] = []
        for relative, line in enumerate(f):
            if 0 <= piece.stop <= pos:
                break
            pos += len(line)
            if not line.strip():
                continue
            obj = _parse_json(line, functools.partial(where, relative), whole=False)
            if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
                _text_field(obj, key, where(relative))
            batch.append(obj[key])
            if len(batch) == _BATCH_ROWS:
                yield batch
                batch = []
        if batch:
            yield batch


def _json_documents(piece: Piece, key: str) -> Iterator[list[str | None]]:
    path = Path(piece.path)
    plain = path.suffix.lower() not in COMPRESSED_SUFFIXES
    if (path.suffix if plain else Path(path.stem).suffix).lower() == ".json":
        with _open_binary(path) as f:
            head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        if head.startswith(b"["):
            yield from _json_array(path, key)
            return
    yield from _json_lines(piece, key)


def _text_column(pa: Any, schema: Any, key: str, path: Path) -> None:
    if key not in schema.names:
        names = [repr(n) for n in schema.names[:10]] + (["..."] if len(schema.names) > 10 else [])
        raise DataError(
            f"{path} has no column {key!r}; its columns are {', '.join(names) or '(none)'}; "
            "name the column that holds the text with --text-key (jsonl_key= in Python)"
        )
    kind = schema.field(key).type
    if not (
        pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"
    ):
        raise DataError(f"column {key!r} of {path} holds {kind}, not strings; name a text column")


def _table_documents(piece: Piece, key: str) -> Iterator[Any]:
    path = Path(piece.path)
    pa = _pyarrow(path)
    if piece.kind == "parquet":
        parquet = importlib.import_module("pyarrow.parquet").ParquetFile(path)
        _text_column(pa, parquet.schema_arrow, key, path)
        groups = list(range(piece.start, piece.stop))
        if groups:
            for batch in parquet.iter_batches(_BATCH_ROWS, row_groups=groups, columns=[key]):
                yield batch.column(0)
        return
    with pa.memory_map(str(path)) as source:
        reader = _arrow_reader(pa, source)
        _text_column(pa, reader.schema, key, path)
        if hasattr(reader, "num_record_batches"):
            batches: Iterator[Any] = (reader.get_batch(i) for i in range(piece.start, piece.stop))
        else:
            batches = itertools.islice(reader, piece.start, piece.stop)
        for batch in batches:
            yield batch.column(key)


def piece_documents(piece: Piece, key: str) -> Iterator[list[str | None] | Any]:
    """The documents of ``piece`` in order, in batches: lists of texts, or Arrow string arrays
    (parquet, arrow); None or a null is an empty document. Bad input is one sentence."""
    if piece.kind in ("parquet", "arrow"):
        yield from _table_documents(piece, key)
    elif piece.kind == "json":
        yield from _json_documents(piece, key)
    else:
        data = Path(piece.path).read_bytes()
        try:
            yield [data.decode("utf-8")]
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{piece.path} is not valid UTF-8 text ({exc.reason} at byte {exc.start}); "
                "convert it to UTF-8"
            ) from None
