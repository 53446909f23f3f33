"""One output shard of ``preprocess``: the pieces of input it covers, tokenized into a
``.bin``/``.idx`` pair, written atomically, and a small JSON record of what it holds.

A shard is complete when its record exists (written last, by rename) and its pair opens with
the counts the record gives; anything else in the shard folder (temporary files of a run that
was stopped) is redone, so a stopped run resumes where it was.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from mega_pretrain.data.indexed import IndexedTokenDataset, IndexedTokenWriter
from mega_pretrain.data.sources import Piece, piece_documents
from mega_pretrain.data.tokenizers import ByteTokenizer, Tokenizer

__all__ = [
    "ShardJob",
    "ShardResult",
    "completed_shard",
    "encode_batch",
    "shard_prefix",
    "write_shard",
]


@dataclass(frozen=True)
class ShardJob:
    """What every shard of one ``preprocess`` call shares (sent once to each worker)."""

    folder: Path
    tokenizer: Tokenizer
    key: str
    append_eod: bool


@dataclass(frozen=True)
class ShardResult:
    """What one shard holds."""

    documents: int
    tokens: int
    skipped: int
    bytes: int


def shard_prefix(folder: Path, index: int) -> Path:
    return folder / f"shard-{index:06d}"


def _record_path(folder: Path, index: int) -> Path:
    return folder / f"shard-{index:06d}.json"


def _byte_arrow(batch: Any) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64], int] | None:
    """UTF-8 bytes and lengths of the non-empty strings of an Arrow array, without a Python
    string per row; None when its nulls hold bytes (read row by row then)."""
    pa = importlib.import_module("pyarrow")
    if not (pa.types.is_string(batch.type) or pa.types.is_large_string(batch.type)):
        batch = batch.cast(pa.large_string())
    wide = pa.types.is_large_string(batch.type)
    buffers = batch.buffers()
    offsets = np.frombuffer(buffers[1], dtype=np.int64 if wide else np.int32)
    offsets = offsets[batch.offset : batch.offset + len(batch) + 1].astype(np.int64)
    lengths = np.diff(offsets)
    if batch.null_count:
        nulls = ~batch.is_valid().to_numpy(zero_copy_only=False)
        if np.any(lengths[nulls]):
            return None
    data = np.frombuffer(buffers[2], dtype=np.uint8) if buffers[2] is not None else np.zeros(0)
    keep = lengths > 0
    return data[offsets[0] : offsets[-1]], lengths[keep], int(len(batch) - keep.sum())


def encode_batch(
    tokenizer: Tokenizer, batch: list[str | None] | Any, append_eod: bool
) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64], int]:
    """(ids of the batch's non-empty documents back to back, each document's length, number
    of empty documents skipped); each document ends with the EOD id when ``append_eod``."""
    byte = isinstance(tokenizer, ByteTokenizer)
    flat: npt.NDArray[Any]
    packed = _byte_arrow(batch) if byte and not isinstance(batch, list) else None
    if packed is not None:
        flat, lengths, skipped = packed
    else:
        texts = batch if isinstance(batch, list) else batch.to_pylist()
        if byte:  # the bytes are the ids
            encoded = [t.encode("utf-8") for t in texts if t]
            flat = np.frombuffer(b"".join(encoded), dtype=np.uint8)
            lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        else:
            ids = [tokenizer.encode(t) for t in texts if t]
            ids = [i for i in ids if i]
            lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            flat = np.fromiter(
                (t for doc in ids for t in doc), dtype=np.int64, count=int(lengths.sum())
            )
        skipped = len(texts) - lengths.size
    if append_eod and lengths.size:
        wide = np.uint16 if tokenizer.eod_id < 2**16 and flat.dtype == np.uint8 else np.int64
        flat = np.insert(flat.astype(wide), np.cumsum(lengths), tokenizer.eod_id)
        lengths = lengths + 1
    return flat, lengths, skipped


def write_shard(
    job: ShardJob,
    index: int,
    pieces: Sequence[Piece],
    report: Callable[[int, int], None] = lambda documents, tokens: None,
) -> ShardResult:
    """Tokenize ``pieces`` into shard ``index`` of ``job.folder``; ``report(documents, tokens)``
    is called after each batch. Bad input raises :class:`DataError` and leaves no pair."""
    tok = job.tokenizer
    documents = tokens = skipped = 0
    eod = tok.eod_id if job.append_eod else None
    with IndexedTokenWriter(shard_prefix(job.folder, index), tok.vocab_size, eod_id=eod) as writer:
        for piece in pieces:
            for batch in piece_documents(piece, job.key):
                flat, lengths, empty = encode_batch(tok, batch, job.append_eod)
                writer.add_documents(flat, lengths)
                documents += lengths.size
                tokens += flat.size
                skipped += empty
                report(int(lengths.size), int(flat.size))
    result = ShardResult(documents, tokens, skipped, sum(p.nbytes for p in pieces))
    record = _record_path(job.folder, index)
    temp = record.with_name(f"{record.name}.tmp-{os.getpid()}")
    temp.write_text(json.dumps(result.__dict__))
    os.replace(temp, record)
    return result


def completed_shard(folder: Path, index: int) -> ShardResult | None:
    """The record of shard ``index`` when the shard is complete and intact, else None."""
    try:
        result = ShardResult(**json.loads(_record_path(folder, index).read_text()))
        data = IndexedTokenDataset(shard_prefix(folder, index))
    except (OSError, ValueError, TypeError):  # missing, half-written or damaged: redo it
        return None
    if (len(data), data.num_tokens) != (result.documents, result.tokens):
        return None
    return result
