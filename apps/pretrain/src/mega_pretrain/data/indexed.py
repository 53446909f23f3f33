"""The indexed token format: ``<prefix>.bin`` holds the tokens, ``<prefix>.idx`` the documents.

``.bin`` is the raw concatenation of every document's token ids, little-endian ``uint16`` when
the vocabulary fits (ids below 65536) else ``int32``, and nothing else, so it memory-maps as
one flat array. ``.idx`` is a 64-byte header followed by ``num_docs + 1`` little-endian
``int64`` offsets into ``.bin`` (in tokens; document ``i`` is ``offsets[i]:offsets[i+1]``):

====== ===== =========================================================================
offset bytes field
====== ===== =========================================================================
0      8     magic ``b"MEGAIDX\\0"``
8      4     format version (``uint32``, 1)
12     4     dtype code (``uint32``: 1 = uint16, 2 = int32)
16     8     vocab_size (``uint64``)
24     8     num_docs (``uint64``)
32     8     num_tokens (``uint64``)
40     8     eod_id (``int64``; -1 when no end-of-document token was appended)
48     16    fingerprint of ``.bin`` (blake2b-128 of its size, first and last 64 KiB)
====== ===== =========================================================================

Both files are written to temporary names and moved into place with ``os.replace``, ``.bin``
first; the fingerprint catches an ``.idx`` paired with a ``.bin`` from another run. Reading
uses numpy only, never pickle.

:class:`IndexedTokenDataset` also reads Megatron-LM's indexed dataset as is: an ``.idx`` that
begins with Megatron's ``MMIDIDX`` magic is recognised by it (no flag), checked and mapped by
:mod:`mega_pretrain.data.megatron`, and serves the same documents-and-windows interface.
"""

from __future__ import annotations

import array
import hashlib
import os
import secrets
import shutil
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from mega_pretrain.data.errors import DataError
from mega_pretrain.data.megatron import MEGATRON_MAGIC, MegatronIndex, read_megatron_index

__all__ = [
    "IndexHeader",
    "IndexedTokenDataset",
    "IndexedTokenWriter",
    "index_format",
    "token_dtype",
]

MAGIC = b"MEGAIDX\x00"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQq16s")
assert HEADER.size == 64
_DTYPES: dict[int, np.dtype[Any]] = {1: np.dtype("<u2"), 2: np.dtype("<i4")}
_FINGERPRINT_SPAN = 64 * 1024


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """``uint16`` when every id of the vocabulary fits in it, else ``int32``."""
    return _DTYPES[1] if vocab_size <= 2**16 else _DTYPES[2]


def _fingerprint(bin_path: Path, nbytes: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(nbytes.to_bytes(8, "little"))
    with open(bin_path, "rb") as f:
        h.update(f.read(_FINGERPRINT_SPAN))
        f.seek(max(0, nbytes - _FINGERPRINT_SPAN))
        h.update(f.read(_FINGERPRINT_SPAN))
    return h.digest()


def _create_temp(final: Path) -> tuple[Path, BinaryIO]:
    """A new file beside ``final`` under a unique name (the umask applies, as to ``final``)."""
    path = final.with_name(f"{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    return path, open(path, "xb")


def _paths(prefix: str | Path) -> tuple[Path, Path]:
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")


def _copy_file(src: BinaryIO, dst: BinaryIO) -> None:
    """All of ``src`` appended to ``dst``: in the kernel where it can (``copy_file_range``)."""
    dst.flush()
    left = os.fstat(src.fileno()).st_size
    try:
        while left > 0:
            done = os.copy_file_range(src.fileno(), dst.fileno(), min(left, 1 << 30))
            if done == 0:
                break
            left -= done
    except (AttributeError, OSError):  # not Linux, or a file system without it
        pass
    if left > 0:
        src.seek(os.fstat(src.fileno()).st_size - left)
        dst.seek(0, os.SEEK_END)
        shutil.copyfileobj(src, dst, 16 << 20)


@dataclass(frozen=True)
class IndexHeader:
    """The fields of an ``.idx`` header (for a Megatron index: what it records, and
    ``vocab_size``/``eod_id`` None, ``fingerprint`` empty, since it records neither)."""

    dtype: np.dtype[Any]
    vocab_size: int | None
    num_docs: int
    num_tokens: int
    eod_id: int | None
    fingerprint: bytes
    format: str = "mega"
    """``"mega"`` or ``"megatron"``: which of the two formats the ``.idx`` is in."""


class IndexedTokenWriter:
    """Writes documents of token ids to ``<prefix>.bin`` / ``<prefix>.idx``, atomically.

    >>> with IndexedTokenWriter("/tmp/corpus", vocab_size=257, eod_id=256) as w:
    ...     w.add_document([104, 105, 256])

    Nothing appears at the prefix until :meth:`finalize` (called on leaving the ``with``
    block); an exception inside the block removes the temporary files and leaves any earlier
    pair at the prefix as it was. ``eod_id`` is only recorded in the header (documents are
    stored exactly as given).
    """

    def __init__(self, prefix: str | Path, vocab_size: int, *, eod_id: int | None = None) -> None:
        if not isinstance(vocab_size, int) or not 0 < vocab_size < 2**31:
            raise ValueError(f"vocab_size ({vocab_size!r}) must be an integer in 1..2**31-1")
        if eod_id is not None and not 0 <= eod_id < vocab_size:
            raise ValueError(f"eod_id ({eod_id}) is outside the vocabulary 0..{vocab_size - 1}")
        self.bin_path, self.idx_path = _paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self.vocab_size = vocab_size
        self.eod_id = eod_id
        self.dtype = token_dtype(vocab_size)
        self._offsets = array.array("q", [0])  # 8 bytes a document, not a list's 36
        self._tmp_bin, bin_file = _create_temp(self.bin_path)
        self._bin: BinaryIO | None = bin_file
        self._tmp_idx: Path | None = None

    @property
    def num_docs(self) -> int:
        return len(self._offsets) - 1

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def add_document(self, tokens: Sequence[int] | npt.NDArray[Any]) -> None:
        """Append one document (it may be empty)."""
        ids = np.asarray(tokens)
        if ids.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of ids, got shape {ids.shape}")
        self.add_documents(ids, [ids.size])

    def add_documents(
        self, tokens: npt.NDArray[Any], lengths: Sequence[int] | npt.NDArray[Any]
    ) -> None:
        """Append ``len(lengths)`` documents stored back to back in ``tokens`` (1-D)."""
        if self._bin is None:
            raise RuntimeError(f"writer for {self.bin_path} is already closed")
        ids = np.asarray(tokens)
        sizes = np.asarray(lengths, dtype=np.int64)
        if ids.ndim != 1 or sizes.ndim != 1 or int(sizes.sum()) != ids.size or np.any(sizes < 0):
            raise ValueError(
                f"documents of lengths summing to {int(sizes.sum())} do not cut {ids.size} "
                "tokens; give 1-D ids and non-negative lengths that add up to their count"
            )
        if ids.size:
            if not np.issubdtype(ids.dtype, np.integer):
                raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(
                    f"token id {bad} is outside the vocabulary 0..{self.vocab_size - 1}; "
                    "the tokenizer and vocab_size disagree"
                )
            self._bin.write(ids.astype(self.dtype, copy=False).tobytes())
        ends = self._offsets[-1] + np.cumsum(sizes, dtype=np.int64)
        self._offsets.frombytes(ends.astype(np.int64, copy=False).tobytes())

    def add_indexed(self, source: IndexedTokenDataset) -> None:
        """Append every document of a mega token file of this vocabulary, copying its
        ``.bin`` bytes as they are (how preprocess merges its shards)."""
        if self._bin is None:
            raise RuntimeError(f"writer for {self.bin_path} is already closed")
        if source.header.format != "mega" or source.header.dtype != self.dtype:
            raise ValueError(
                f"{source.prefix} ({source.header.format}, {source.header.dtype}) cannot be "
                f"appended as is to a {self.dtype} mega token file; re-tokenize it"
            )
        with open(source.bin_path, "rb") as f:
            _copy_file(f, self._bin)
        base = self._offsets[-1]
        offsets = source.doc_offsets
        for start in range(1, offsets.size, 1 << 20):  # chunked: no copy of a large index
            chunk = np.asarray(offsets[start : start + (1 << 20)], dtype=np.int64) + base
            self._offsets.frombytes(chunk.tobytes())

    def finalize(self) -> IndexHeader:
        """Write the index and move both files into place; returns the header written."""
        if self._bin is None:
            raise RuntimeError(f"writer for {self.bin_path} is already closed")
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            self._bin = None
            nbytes = self.num_tokens * self.dtype.itemsize
            header = IndexHeader(
                dtype=self.dtype,
                vocab_size=self.vocab_size,
                num_docs=self.num_docs,
                num_tokens=self.num_tokens,
                eod_id=self.eod_id,
                fingerprint=_fingerprint(self._tmp_bin, nbytes),
            )
            code = next(c for c, d in _DTYPES.items() if d == self.dtype)
            self._tmp_idx, idx_file = _create_temp(self.idx_path)
            with idx_file as f:
                f.write(
                    HEADER.pack(
                        MAGIC,
                        VERSION,
                        code,
                        header.vocab_size,
                        header.num_docs,
                        header.num_tokens,
                        -1 if header.eod_id is None else header.eod_id,
                        header.fingerprint,
                    )
                )
                f.write(np.frombuffer(self._offsets, dtype=np.int64).astype("<i8").tobytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(self._tmp_bin, self.bin_path)
            os.replace(self._tmp_idx, self.idx_path)
            self._tmp_idx = None
            return header
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Drop what was written; any earlier pair at the prefix stays as it was."""
        if self._bin is not None:
            self._bin.close()
            self._bin = None
        for tmp in (self._tmp_bin, self._tmp_idx):
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedTokenWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def index_format(idx_path: Path) -> str:
    """``"mega"`` or ``"megatron"``, told by the magic the ``.idx`` begins with (checked before
    any length, so a short file gets its own format's message); one sentence otherwise."""
    if not idx_path.is_file():
        raise DataError(
            f"index file {idx_path} does not exist; create it with `mega-pretrain preprocess`"
        )
    with open(idx_path, "rb") as f:
        raw = f.read(len(MEGATRON_MAGIC))
    if raw.startswith(MEGATRON_MAGIC):
        return "megatron"
    if raw[: len(MAGIC)] == MAGIC:
        return "mega"
    if len(raw) < len(MEGATRON_MAGIC) and (MEGATRON_MAGIC.startswith(raw) or MAGIC.startswith(raw)):
        raise DataError(
            f"index file {idx_path} is truncated ({len(raw)} bytes, shorter than its format's "
            "magic); preprocess the data again"
        )
    raise DataError(
        f"{idx_path} is neither a mega token index nor a Megatron indexed dataset (it starts "
        f"with {raw[: len(MAGIC)]!r}); give the prefix of files written by `mega-pretrain "
        "preprocess` or by Megatron-LM's preprocessing"
    )


def read_header(idx_path: Path) -> IndexHeader:
    """Read and check a mega ``.idx`` header (and the file's length); one sentence on failure.
    The magic is checked first, so a short file of another format is not called truncated."""
    if index_format(idx_path) != "mega":
        raise DataError(
            f"{idx_path} is a Megatron index, not a mega token index; open it with "
            "IndexedTokenDataset, which reads both"
        )
    size = idx_path.stat().st_size
    with open(idx_path, "rb") as f:
        raw = f.read(HEADER.size)
    if len(raw) < HEADER.size:
        raise DataError(
            f"index file {idx_path} is truncated ({size} bytes, shorter than its "
            f"{HEADER.size}-byte header); preprocess the data again"
        )
    _, version, code, vocab, docs, tokens, eod, fingerprint = HEADER.unpack(raw)
    if version != VERSION:
        raise DataError(
            f"index file {idx_path} has format version {version}, but this reader knows "
            f"version {VERSION}; preprocess the data again"
        )
    if code not in _DTYPES:
        raise DataError(f"index file {idx_path} names unknown dtype code {code}; it is corrupt")
    expected = HEADER.size + 8 * (docs + 1)
    if size != expected:
        raise DataError(
            f"index file {idx_path} is {'truncated' if size < expected else 'corrupt'}: "
            f"{size} bytes where {docs} documents need {expected}; preprocess the data again"
        )
    return IndexHeader(
        dtype=_DTYPES[code],
        vocab_size=vocab,
        num_docs=docs,
        num_tokens=tokens,
        eod_id=None if eod < 0 else eod,
        fingerprint=fingerprint,
    )


class IndexedTokenDataset:
    """Memory-mapped documents of a ``<prefix>.bin`` / ``<prefix>.idx`` pair, in mega's
    format or Megatron-LM's (told by the ``.idx`` magic; ``ds.header.format`` says which).

    ``len(ds)`` is the number of documents; ``ds.doc(i)`` one document's ids; ``ds.tokens(start,
    length)`` a window of the concatenation of all documents. Opening checks the header, the
    sizes of both files, the offsets and the fingerprint, and names the file in one sentence
    if anything is wrong. Pickles as its prefix (DataLoader workers re-open the files).

    A Megatron document is a range of sequences; here it is one document holding their tokens
    in order (see :mod:`mega_pretrain.data.megatron`), ``vocab_size`` and ``eod_id`` are None
    (the index records neither), and ``ds.megatron`` holds the mapped sequence arrays.
    """

    def __init__(self, prefix: str | Path) -> None:
        self._open(Path(prefix))

    def _open(self, prefix: Path) -> None:
        self.prefix = prefix
        self.bin_path, self.idx_path = _paths(prefix)
        self.megatron: MegatronIndex | None = None
        if index_format(self.idx_path) == "megatron":
            self._open_megatron()
            return
        self.header = read_header(self.idx_path)
        h, idx, binp = self.header, self.idx_path, self.bin_path
        offsets = np.memmap(idx, dtype="<i8", mode="r", offset=HEADER.size, shape=(h.num_docs + 1,))
        if int(offsets[0]) != 0 or int(offsets[-1]) != h.num_tokens:
            raise DataError(
                f"index file {idx} is corrupt: its offsets run from {int(offsets[0])} to "
                f"{int(offsets[-1])}, not 0 to {h.num_tokens}; preprocess the data again"
            )
        for start in range(0, h.num_docs, 1 << 20):  # chunked: no copy of a large index
            if np.any(np.diff(offsets[start : start + (1 << 20) + 1]) < 0):
                raise DataError(
                    f"index file {idx} is corrupt: its document offsets decrease; "
                    "preprocess the data again"
                )
        if not binp.is_file():
            raise DataError(f"token file {binp} does not exist, though its index {idx} does")
        nbytes = h.num_tokens * h.dtype.itemsize
        if binp.stat().st_size != nbytes:
            raise DataError(
                f"token file {binp} holds {binp.stat().st_size} bytes, but its index expects "
                f"{nbytes} ({h.num_tokens} tokens of {h.dtype.name}); preprocess the data again"
            )
        if _fingerprint(binp, nbytes) != h.fingerprint:
            raise DataError(
                f"token file {binp} does not match its index {idx} (fingerprint differs: the "
                "two come from different runs); preprocess the data again"
            )
        self._offsets: npt.NDArray[np.int64] = offsets
        self._bin: npt.NDArray[Any] = (
            np.memmap(binp, dtype=h.dtype, mode="r", shape=(h.num_tokens,))
            if h.num_tokens
            else np.empty(0, dtype=h.dtype)  # an empty file cannot be mapped
        )

    def _open_megatron(self) -> None:
        index = self.megatron = read_megatron_index(self.idx_path)
        binp, idx = self.bin_path, self.idx_path
        self.header = IndexHeader(
            dtype=index.dtype,
            vocab_size=None,
            num_docs=index.num_docs,
            num_tokens=index.num_tokens,
            eod_id=None,
            fingerprint=b"",
            format="megatron",
        )
        if not binp.is_file():
            raise DataError(f"token file {binp} does not exist, though its index {idx} does")
        nbytes = index.num_tokens * index.dtype.itemsize
        size = binp.stat().st_size
        if size != nbytes:
            state = "shorter than" if size < nbytes else "longer than"
            raise DataError(
                f"token file {binp} holds {size} bytes, {state} the {nbytes} its Megatron index "
                f"{idx} points to ({index.num_tokens} tokens of {index.dtype.name}); the two do "
                "not belong together, or the .bin was cut short"
            )
        self._offsets = index.doc_offsets
        self._bin = (
            np.memmap(binp, dtype=index.dtype, mode="r", shape=(index.num_tokens,))
            if index.num_tokens
            else np.empty(0, dtype=index.dtype)
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._open(state["prefix"])

    def __len__(self) -> int:
        return self.header.num_docs

    @property
    def num_tokens(self) -> int:
        return self.header.num_tokens

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary the file was written for; None for a Megatron file (not recorded)."""
        return self.header.vocab_size

    @property
    def eod_id(self) -> int | None:
        return self.header.eod_id

    @property
    def doc_offsets(self) -> npt.NDArray[np.int64]:
        """Where each document starts in ``.bin``, and where the last ends: ``[num_docs + 1]``."""
        return self._offsets

    def doc(self, i: int) -> npt.NDArray[Any]:
        """Token ids of document ``i`` (a copy, in the file's dtype)."""
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} is out of range for {len(self)} documents")
        return np.array(self._bin[int(self._offsets[i]) : int(self._offsets[i + 1])])

    def tokens(self, start: int, length: int) -> npt.NDArray[Any]:
        """``length`` ids of the concatenation of all documents from ``start`` (a copy)."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(
                f"tokens [{start}, {start + length}) are out of range for {self.num_tokens} tokens"
            )
        return np.array(self._bin[start : start + length])

    def __repr__(self) -> str:
        what = "Megatron format" if self.megatron is not None else f"vocab {self.vocab_size}"
        return (
            f"IndexedTokenDataset({str(self.prefix)!r}: {len(self)} documents, "
            f"{self.num_tokens} tokens, {what})"
        )
