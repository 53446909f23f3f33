"""Megatron-LM's indexed dataset (``MMIDIDX``), read as is: its ``.idx`` checked and mapped.

``.bin`` holds every sequence's ids back to back in the dataset's dtype, no header. ``.idx``
(little-endian):

====== ================================ ====================================================
offset size                             field
====== ================================ ====================================================
0      9                                magic ``b"MMIDIDX\\x00\\x00"``
9      8                                version (``uint64``, 1)
17     1                                dtype code (``uint8``, :data:`MEGATRON_DTYPES`)
18     8                                sequence_count ``S`` (``uint64``)
26     8                                document_count ``D`` (``uint64``; documents + 1)
34     4 S                              ``int32`` sequence lengths (tokens)
..     8 S                              ``int64`` sequence pointers (bytes into ``.bin``)
..     8 D                              ``int64`` document indices (sequence boundaries)
====== ================================ ====================================================

A Megatron document is the sequences ``document_indices[d] .. document_indices[d+1] - 1``
(one sequence each unless it was preprocessed with ``--split-sentences``). For mega a
document is that whole range: its tokens are its sequences' tokens in order with nothing
between them, so a document is the unit of the train/valid split and sentences of one
document stay together. The index records no vocabulary and no end-of-document id: the ids
are read as stored (an EOD is there when Megatron's preprocessing appended one).

mega reads the concatenation of all sequences as one flat array, so the pointers must be the
running sum of ``length * itemsize`` (what Megatron's writer produces); anything else, and
every other inconsistency, is one sentence naming the file. numpy memory maps only, never
pickle.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from mega_pretrain.data.errors import DataError

__all__ = ["MEGATRON_DTYPES", "MEGATRON_MAGIC", "MegatronIndex", "read_megatron_index"]

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_VERSION = 1
MEGATRON_HEADER = struct.Struct("<9sQBQQ")
assert MEGATRON_HEADER.size == 34
MEGATRON_DTYPES: dict[int, np.dtype[Any]] = {
    1: np.dtype("u1"),
    2: np.dtype("i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),
    7: np.dtype("<f4"),
    8: np.dtype("<u2"),
}
_CHUNK = 1 << 20  # index entries checked per numpy call: no copy of a large index
_AGAIN = "preprocess the data again or give another prefix"


@dataclass(frozen=True)
class MegatronIndex:
    """A checked Megatron ``.idx``: its arrays memory-mapped, the documents' token offsets."""

    dtype: np.dtype[Any]
    num_sequences: int
    num_tokens: int
    sequence_lengths: npt.NDArray[np.int32]  # [S], memory-mapped
    sequence_pointers: npt.NDArray[np.int64]  # [S], memory-mapped
    document_indices: npt.NDArray[np.int64]  # [D], memory-mapped
    doc_offsets: npt.NDArray[np.int64]  # [D]: where each document starts in tokens, and the end

    @property
    def num_docs(self) -> int:
        return int(self.doc_offsets.size) - 1


def read_megatron_index(idx_path: Path) -> MegatronIndex:
    """Check a Megatron ``.idx`` (header, size, lengths, pointers, document indices) and map
    it; one sentence naming the file on any problem. ``.bin`` is checked by the caller."""
    size = idx_path.stat().st_size
    with open(idx_path, "rb") as f:
        raw = f.read(MEGATRON_HEADER.size)
    if len(raw) < MEGATRON_HEADER.size:
        raise DataError(
            f"Megatron index file {idx_path} is truncated ({size} bytes, shorter than its "
            f"{MEGATRON_HEADER.size}-byte header); {_AGAIN}"
        )
    magic, version, code, seqs, docs = MEGATRON_HEADER.unpack(raw)
    if magic != MEGATRON_MAGIC:
        raise DataError(f"{idx_path} is not a Megatron index (it starts with {magic!r})")
    if version != MEGATRON_VERSION:
        raise DataError(
            f"Megatron index file {idx_path} has version {version}, but this reader knows "
            f"version {MEGATRON_VERSION}; {_AGAIN}"
        )
    if code not in MEGATRON_DTYPES:
        raise DataError(
            f"Megatron index file {idx_path} names unknown dtype code {code} (Megatron's "
            f"codes are 1..8); it is corrupt"
        )
    dtype = MEGATRON_DTYPES[code]
    expected = MEGATRON_HEADER.size + 12 * seqs + 8 * docs
    if size != expected:
        if size == expected + seqs and seqs:
            what = "a multimodal index (sequence modes follow the document indices), which mega does not read"
        else:
            state = "truncated" if size < expected else "corrupt"
            what = f"{state}: {size} bytes where {seqs} sequences and {docs} document indices need {expected}"
        raise DataError(f"Megatron index file {idx_path} is {what}; {_AGAIN}")
    if docs < 1:
        raise DataError(
            f"Megatron index file {idx_path} is corrupt: it has no document indices (at least "
            f"the leading 0 is written); {_AGAIN}"
        )
    at = MEGATRON_HEADER.size
    lengths = (
        np.memmap(idx_path, dtype="<i4", mode="r", offset=at, shape=(seqs,))
        if seqs
        else np.empty(0, "<i4")
    )
    at += 4 * seqs
    pointers = (
        np.memmap(idx_path, dtype="<i8", mode="r", offset=at, shape=(seqs,))
        if seqs
        else np.empty(0, "<i8")
    )
    at += 8 * seqs
    doc_indices = np.memmap(idx_path, dtype="<i8", mode="r", offset=at, shape=(docs,))
    num_tokens = _check_sequences(idx_path, lengths, pointers, dtype.itemsize)
    _check_documents(idx_path, doc_indices, seqs)
    return MegatronIndex(
        dtype=dtype,
        num_sequences=seqs,
        num_tokens=num_tokens,
        sequence_lengths=lengths,
        sequence_pointers=pointers,
        document_indices=doc_indices,
        doc_offsets=_doc_offsets(doc_indices, pointers, dtype.itemsize, num_tokens),
    )


def _check_sequences(
    idx_path: Path, lengths: npt.NDArray[Any], pointers: npt.NDArray[Any], itemsize: int
) -> int:
    """Lengths non-negative, pointers the running sum of ``length * itemsize`` from 0; the
    total number of tokens."""
    total = 0  # tokens before the chunk
    for start in range(0, lengths.size, _CHUNK):
        chunk = np.asarray(lengths[start : start + _CHUNK], dtype=np.int64)
        if chunk.size and int(chunk.min()) < 0:
            bad = start + int(np.argmax(chunk < 0))
            raise DataError(
                f"Megatron index file {idx_path} is corrupt: sequence {bad} has length "
                f"{int(lengths[bad])}; {_AGAIN}"
            )
        starts = total + np.concatenate([[0], np.cumsum(chunk[:-1], dtype=np.int64)])
        found = np.asarray(pointers[start : start + _CHUNK])
        wrong = np.flatnonzero(found != starts * itemsize)
        if wrong.size:
            bad = start + int(wrong[0])
            raise DataError(
                f"Megatron index file {idx_path} is corrupt: sequence {bad} points to byte "
                f"{int(pointers[bad])} of the .bin, not {int(starts[wrong[0]]) * itemsize} "
                f"(the running sum of the lengths before it); {_AGAIN}"
            )
        total += int(chunk.sum())
    return total


def _check_documents(idx_path: Path, doc_indices: npt.NDArray[Any], seqs: int) -> None:
    """Document indices run from 0 to the sequence count and never decrease."""
    first, last = int(doc_indices[0]), int(doc_indices[-1])
    if first != 0 or last != seqs:
        raise DataError(
            f"Megatron index file {idx_path} is corrupt: its document indices run from "
            f"{first} to {last}, not 0 to its {seqs} sequences; {_AGAIN}"
        )
    for start in range(0, doc_indices.size, _CHUNK):
        if np.any(np.diff(doc_indices[start : start + _CHUNK + 1]) < 0):
            raise DataError(
                f"Megatron index file {idx_path} is corrupt: its document indices decrease; "
                f"{_AGAIN}"
            )


def _doc_offsets(
    doc_indices: npt.NDArray[Any], pointers: npt.NDArray[Any], itemsize: int, num_tokens: int
) -> npt.NDArray[np.int64]:
    """Token offset of each document boundary: the pointer of its first sequence (the end of
    the data for the final boundary and for trailing empty documents)."""
    out = np.full(doc_indices.size, num_tokens, dtype=np.int64)  # [D]
    seqs = pointers.size
    if not seqs:
        return out
    for start in range(0, doc_indices.size, _CHUNK):
        raw = np.asarray(doc_indices[start : start + _CHUNK])
        di = np.minimum(raw, seqs - 1)
        lo, hi = int(di[0]), int(di[-1]) + 1  # non-decreasing (checked): one contiguous read
        part = np.asarray(pointers[lo:hi])[di - lo] // itemsize
        out[start : start + raw.size] = np.where(raw < seqs, part, num_tokens)
    return out
