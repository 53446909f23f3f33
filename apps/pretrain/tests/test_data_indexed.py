"""The .bin/.idx pair: documents in = documents out, atomic writes, and clear errors on damage."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from mega_pretrain.data import DataError, DocumentSubset, IndexedTokenDataset, IndexedTokenWriter


def _random_docs(rng: np.random.Generator, vocab: int, n: int) -> list[np.ndarray]:
    lengths = rng.integers(0, 50, size=n)
    lengths[::7] = 0  # some empty documents
    return [rng.integers(0, vocab, size=int(k)) for k in lengths]


def _write(prefix: Path, docs: list[np.ndarray], vocab: int, eod: int | None = None) -> None:
    with IndexedTokenWriter(prefix, vocab, eod_id=eod) as writer:
        for doc in docs:
            writer.add_document(doc)


@pytest.mark.parametrize(("vocab", "dtype"), [(257, "uint16"), (65536, "uint16"), (70000, "int32")])
def test_documents_round_trip(tmp_path: Path, vocab: int, dtype: str) -> None:
    rng = np.random.default_rng(vocab)
    docs = _random_docs(rng, vocab, 60)
    docs[3] = np.array([0, vocab - 1])  # both ends of the vocabulary
    _write(tmp_path / "c", docs, vocab, eod=vocab - 1)
    ds = IndexedTokenDataset(tmp_path / "c")
    assert (len(ds), ds.vocab_size, ds.eod_id, ds.header.dtype.name) == (
        60,
        vocab,
        vocab - 1,
        dtype,
    )
    assert (tmp_path / "c.bin").stat().st_size == ds.num_tokens * np.dtype(dtype).itemsize
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds.doc(i), doc)
    every = np.concatenate(docs)
    assert ds.num_tokens == every.size
    np.testing.assert_array_equal(ds.tokens(0, ds.num_tokens), every)
    np.testing.assert_array_equal(ds.tokens(17, 40), every[17:57])
    np.testing.assert_array_equal(np.diff(ds.doc_offsets), [d.size for d in docs])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.bin", "c.idx"]  # no temp files left


def test_document_subset_reads_windows_across_documents(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    docs = _random_docs(rng, 300, 40)
    _write(tmp_path / "c", docs, 300)
    ds = IndexedTokenDataset(tmp_path / "c")
    ids = [5, 0, 33, 7, 21, 14, 39]  # any order, empty documents (0, 7, 14, 21) included
    sub = DocumentSubset(ds, ids)
    reference = np.concatenate([docs[i] for i in ids])
    assert (len(sub), sub.num_tokens) == (len(ids), reference.size)
    for start in range(reference.size):
        for length in (0, 1, 5, 23):
            if start + length <= reference.size:
                np.testing.assert_array_equal(
                    sub.tokens(start, length), reference[start : start + length]
                )
    np.testing.assert_array_equal(DocumentSubset(sub, [2, 0]).tokens(0, docs[33].size + docs[5].size),
                                  np.concatenate([docs[33], docs[5]]))  # fmt: skip
    with pytest.raises(IndexError, match=r"out of range"):
        sub.tokens(reference.size - 2, 3)


def test_failed_write_leaves_the_earlier_pair_and_no_temp_files(tmp_path: Path) -> None:
    _write(tmp_path / "c", [np.arange(10)], 257)
    before = (tmp_path / "c.bin").read_bytes(), (tmp_path / "c.idx").read_bytes()
    with pytest.raises(RuntimeError, match="boom"), IndexedTokenWriter(tmp_path / "c", 257) as w:
        w.add_document(np.arange(5))
        raise RuntimeError("boom")
    with pytest.raises(ValueError, match=r"token id 300 is outside the vocabulary 0\.\.256"):
        with IndexedTokenWriter(tmp_path / "c", 257) as w:
            w.add_document([1, 300])
    assert ((tmp_path / "c.bin").read_bytes(), (tmp_path / "c.idx").read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.bin", "c.idx"]


def test_pickles_as_its_prefix(tmp_path: Path) -> None:
    _write(tmp_path / "c", [np.arange(100), np.arange(7)], 257)
    ds = IndexedTokenDataset(tmp_path / "c")
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # the tokens are not in it
    np.testing.assert_array_equal(pickle.loads(blob).doc(1), np.arange(7))


def _damage_idx(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "magic":
        data[:8] = b"NOTANIDX"
    elif how == "version":
        data[8:12] = struct.pack("<I", 9)
    elif how == "dtype":
        data[12:16] = struct.pack("<I", 7)
    elif how == "truncated":
        del data[-5:]
    elif how == "header":
        del data[30:]
    elif how == "offsets":
        data[64 + 8 : 64 + 16] = struct.pack("<q", 50)  # a document ending past the next
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("how", "message"),
    [
        (
            "magic",
            r"c\.idx is neither a mega token index nor a Megatron indexed dataset \(it starts with b'NOTANIDX'\)",
        ),
        ("version", r"c\.idx has format version 9, but this reader knows version 1"),
        ("dtype", r"c\.idx names unknown dtype code 7; it is corrupt"),
        ("truncated", r"c\.idx is truncated: 83 bytes where 2 documents need 88"),
        ("header", r"c\.idx is truncated \(30 bytes, shorter than its 64-byte header\)"),
        ("offsets", r"c\.idx is corrupt: its document offsets decrease"),
    ],
)
def test_damaged_index_raises_one_sentence_naming_the_file(
    tmp_path: Path, how: str, message: str
) -> None:
    _write(tmp_path / "c", [np.arange(10), np.arange(20)], 257)
    _damage_idx(tmp_path / "c.idx", how)
    with pytest.raises(DataError, match=message) as info:
        IndexedTokenDataset(tmp_path / "c")
    assert "\n" not in str(info.value)


def test_missing_or_mismatched_files_raise_one_sentence(tmp_path: Path) -> None:
    cases = []
    with pytest.raises(DataError, match=r"index file .*nothing\.idx does not exist") as info:
        IndexedTokenDataset(tmp_path / "nothing")
    cases.append(info)
    _write(tmp_path / "c", [np.arange(10), np.arange(20)], 257)
    _write(tmp_path / "d", [np.arange(20), np.arange(10)], 257)  # same sizes, other tokens
    (tmp_path / "c.bin").write_bytes((tmp_path / "d.bin").read_bytes())
    with pytest.raises(DataError, match=r"token file .*c\.bin does not match its index") as info:
        IndexedTokenDataset(tmp_path / "c")
    cases.append(info)
    (tmp_path / "c.bin").write_bytes(b"\0" * 10)
    with pytest.raises(DataError, match=r"c\.bin holds 10 bytes, but its index expects 60") as info:
        IndexedTokenDataset(tmp_path / "c")
    cases.append(info)
    (tmp_path / "c.bin").unlink()
    with pytest.raises(DataError, match=r"token file .*c\.bin does not exist, though its index"):
        IndexedTokenDataset(tmp_path / "c")
    assert all("\n" not in str(c.value) for c in cases)


def test_the_vocabulary_check_reads_a_bounded_sample(tmp_path: Path) -> None:
    """A large file is sampled in evenly spaced windows (first and last included), so an id
    past the model's vocabulary anywhere in a window is found without reading the file."""
    from mega_pretrain.data import check_vocab
    from mega_pretrain.data.vocab_check import sampled_max_id

    ids = np.full(1_000_000, 7, dtype=np.int64)
    ids[-1] = 300  # the last window reaches the end of the file
    with IndexedTokenWriter(tmp_path / "big", vocab_size=301) as writer:
        writer.add_document(ids)
    ds = IndexedTokenDataset(tmp_path / "big")
    reads: list[int] = []
    original = ds.tokens

    def counted(start: int, length: int) -> np.ndarray:
        reads.append(length)
        return original(start, length)

    ds.tokens = counted  # type: ignore[method-assign]
    assert sampled_max_id(ds, blocks=8, block=100) == 300
    assert reads == [100] * 8  # 800 of 1,000,000 tokens read
    check_vocab(tmp_path / "big", 301)  # fits
    idx = tmp_path / "big.idx"  # a header that understates its ids (another tool's file)
    raw = bytearray(idx.read_bytes())
    raw[16:24] = (200).to_bytes(8, "little")
    idx.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"holds token id 300, outside the model's vocab_size 257"):
        check_vocab(tmp_path / "big", 257)
