"""Megatron-LM's indexed dataset read as is: files written here from the documented layout
(every dtype code, multi-sequence documents, a one-document file), each bad input one
sentence, the vocabulary check, blends with mega's own format, and training on it."""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mega_parallel_grid.testing import DistPool
from mega_pretrain.data import (
    BlendedDataset,
    DataError,
    GPTDataset,
    IndexedTokenDataset,
    IndexedTokenWriter,
    check_vocab,
    ensure_default_dataset,
    split_train_valid,
)
from mega_pretrain.data.vocab_check import sampled_max_id

CODES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}


def write_megatron(
    prefix: Path, documents: list[list[np.ndarray]], code: int = 8, *, version: int = 1
) -> None:
    """Write ``documents`` (each a list of sequences of ids) in Megatron's layout: ``.bin``
    the sequences back to back; ``.idx`` magic, version, dtype code, counts, int32 lengths,
    int64 byte pointers (running sums), int64 document indices (0, then each end)."""
    dtype = np.dtype(CODES[code])
    sequences = [np.asarray(s) for doc in documents for s in doc]
    lengths = np.array([s.size for s in sequences], dtype="<i4")
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * dtype.itemsize
    pointers = pointers[: lengths.size].astype("<i8")
    doc_indices = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype("<i8")
    with open(f"{prefix}.bin", "wb") as f:
        for s in sequences:
            f.write(s.astype(dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", version))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", lengths.size))
        f.write(struct.pack("<Q", doc_indices.size))
        f.write(lengths.tobytes() + pointers.tobytes() + doc_indices.tobytes())


def _random_documents(
    rng: np.random.Generator, low: int, high: int, n: int = 25
) -> list[list[np.ndarray]]:
    """``n`` documents of 1..4 sequences (some sequences empty), ids in ``[low, high]``."""
    docs = []
    for _ in range(n):
        k = int(rng.integers(1, 5))
        docs.append(
            [
                rng.integers(low, high, size=int(rng.integers(0, 30)), endpoint=True)
                for _ in range(k)
            ]
        )
    return docs


@pytest.mark.parametrize(
    ("code", "low", "high"),
    [
        (1, 0, 255),
        (2, 0, 127),
        (3, 0, 32767),
        (4, 65536, 2**31 - 1),
        (5, 65536, 2**40),
        (6, 0, 2**53),
        (7, 0, 2**24),
        (8, 0, 65535),
    ],
    ids=["uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16"],
)
def test_every_dtype_code_reads_the_documents_written(
    tmp_path: Path, code: int, low: int, high: int
) -> None:
    docs = _random_documents(np.random.default_rng(code), low, high)
    docs[0] = [np.array([low, high]), np.array([high])]  # both ends of the range
    write_megatron(tmp_path / "m", docs, code)
    ds = IndexedTokenDataset(tmp_path / "m")
    assert ds.header.format == "megatron" and ds.header.dtype == np.dtype(CODES[code])
    assert (len(ds), ds.vocab_size, ds.eod_id) == (len(docs), None, None)
    flat = [np.concatenate(d) for d in docs]  # a document: its sequences' ids in order
    for i, doc in enumerate(flat):
        np.testing.assert_array_equal(ds.doc(i).astype(np.int64), doc)
    every = np.concatenate(flat)
    assert ds.num_tokens == every.size
    np.testing.assert_array_equal(ds.tokens(0, ds.num_tokens).astype(np.int64), every)
    np.testing.assert_array_equal(np.diff(ds.doc_offsets), [d.size for d in flat])
    assert sampled_max_id(ds) == high
    sample = GPTDataset(ds, 8, seed=3, shuffle=False)[2]["tokens"]
    assert sample.dtype == torch.int64 and sample.tolist() == every[16:24].tolist()


def test_multi_sequence_documents_stay_whole(tmp_path: Path) -> None:
    """A document of several sequences (Megatron's ``--split-sentences``) is one mega
    document: read whole, split into train/valid whole, with empty sequences and documents."""
    rng = np.random.default_rng(7)
    docs = _random_documents(rng, 0, 999, n=40)
    docs[5] = []  # a document of no sequence
    docs[6] = [np.zeros(0, dtype=np.int64)] * 3  # of empty sequences only
    write_megatron(tmp_path / "m", docs, 8)
    ds = IndexedTokenDataset(tmp_path / "m")
    assert ds.megatron is not None
    assert ds.megatron.num_sequences == sum(len(d) for d in docs)
    np.testing.assert_array_equal(
        ds.megatron.document_indices, np.cumsum([0, *[len(d) for d in docs]])
    )
    flat = [np.concatenate(d) if d else np.zeros(0, dtype=np.int64) for d in docs]
    assert ds.doc(5).size == ds.doc(6).size == 0
    train, valid = split_train_valid(ds, 0.25, seed=1)
    for part in (train, valid):
        for i, d in enumerate(part.doc_ids):
            np.testing.assert_array_equal(part.doc(i), flat[int(d)])
        np.testing.assert_array_equal(
            part.tokens(0, part.num_tokens), np.concatenate([flat[int(d)] for d in part.doc_ids])
        )
    assert sorted([*train.doc_ids, *valid.doc_ids]) == list(range(40))


def test_a_one_document_file_is_62_bytes_and_not_called_truncated(tmp_path: Path) -> None:
    """The magic is read before any length: a 62-byte Megatron index is shorter than mega's
    64-byte header and opens; a short file of either format is told in its own words."""
    write_megatron(tmp_path / "one", [[np.array([5, 6, 7])]], 8)
    assert (tmp_path / "one.idx").stat().st_size == 62 == 34 + 4 + 8 + 2 * 8
    ds = IndexedTokenDataset(tmp_path / "one")
    assert (len(ds), ds.doc(0).tolist()) == (1, [5, 6, 7])
    raw = (tmp_path / "one.idx").read_bytes()
    (tmp_path / "one.idx").write_bytes(raw[:20])
    with pytest.raises(DataError, match=r"Megatron index file .*one\.idx is truncated \(20 bytes"):
        IndexedTokenDataset(tmp_path / "one")
    (tmp_path / "one.idx").write_bytes(raw[:5])
    with pytest.raises(DataError, match=r"one\.idx is truncated \(5 bytes, shorter than its"):
        IndexedTokenDataset(tmp_path / "one")
    write_megatron(tmp_path / "empty", [], 8)  # no document: [0] as its document indices
    assert len(IndexedTokenDataset(tmp_path / "empty")) == 0


def test_pickles_as_its_prefix(tmp_path: Path) -> None:
    write_megatron(tmp_path / "m", [[np.arange(100)], [np.arange(3), np.arange(4)]], 4)
    blob = pickle.dumps(IndexedTokenDataset(tmp_path / "m"))
    assert len(blob) < 1000
    assert pickle.loads(blob).doc(1).tolist() == [0, 1, 2, 0, 1, 2, 3]


def _damage(prefix: Path, how: str) -> None:
    idx, binp = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    data = bytearray(idx.read_bytes())
    seqs = 3  # the file written below: documents [[a, b], [c]]
    if how == "dtype":
        data[17] = 9
    elif how == "dtype-zero":
        data[17] = 0
    elif how == "version":
        data[9:17] = struct.pack("<Q", 2)
    elif how == "truncated":
        del data[-5:]
    elif how == "header":
        del data[25:]
    elif how == "multimodal":
        data += bytes(seqs)
    elif how == "length":
        data[34:38] = struct.pack("<i", -1)
    elif how == "pointer":
        data[34 + 4 * seqs + 8 : 34 + 4 * seqs + 16] = struct.pack("<q", 3)
    elif how == "documents":
        data[-8:] = struct.pack("<q", 2)
    elif how == "decreasing":
        data[-16:-8] = struct.pack("<q", 4)
        data[-8:] = struct.pack("<q", 3)
    elif how == "short-bin":
        binp.write_bytes(binp.read_bytes()[:-2])
    elif how == "long-bin":
        binp.write_bytes(binp.read_bytes() + b"\0\0")
    elif how == "no-bin":
        binp.unlink()
    idx.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("dtype", r"m\.idx names unknown dtype code 9 \(Megatron's codes are 1\.\.8\)"),
        ("dtype-zero", r"m\.idx names unknown dtype code 0"),
        ("version", r"m\.idx has version 2, but this reader knows version 1"),
        ("truncated", r"m\.idx is truncated: 89 bytes where 3 sequences and 3 document indices need 94"),
        ("header", r"m\.idx is truncated \(25 bytes, shorter than its 34-byte header\)"),
        ("multimodal", r"m\.idx is a multimodal index"),
        ("length", r"m\.idx is corrupt: sequence 0 has length -1"),
        ("pointer", r"m\.idx is corrupt: sequence 1 points to byte 3 of the \.bin, not 20"),
        ("documents", r"m\.idx is corrupt: its document indices run from 0 to 2, not 0 to its 3"),
        ("decreasing", r"m\.idx is corrupt: its document indices decrease"),
        ("short-bin", r"m\.bin holds 58 bytes, shorter than the 60 its Megatron index .*m\.idx points to \(15 tokens of int32\)"),
        ("long-bin", r"m\.bin holds 62 bytes, longer than the 60"),
        ("no-bin", r"token file .*m\.bin does not exist, though its index"),
    ],
)  # fmt: skip
def test_bad_megatron_input_is_one_sentence_naming_the_file(
    tmp_path: Path, how: str, message: str
) -> None:
    write_megatron(tmp_path / "m", [[np.arange(5), np.arange(5)], [np.arange(5)]], 4)
    _damage(tmp_path / "m", how)
    with pytest.raises(DataError, match=message) as info:
        IndexedTokenDataset(tmp_path / "m")
    assert "\n" not in str(info.value)


def test_the_vocabulary_check_uses_the_sampled_ids(tmp_path: Path) -> None:
    """Megatron's index records no vocabulary: the ids of a bounded sample decide, negative
    ids of a signed dtype and fractional ids of a float one included."""
    write_megatron(tmp_path / "m", [[np.array([1, 2, 900])], [np.array([3])]], 8)
    check_vocab(tmp_path / "m", 901)
    with pytest.raises(DataError, match=r"m\.bin holds token id 900, outside the model's "
                       r"vocab_size 257 \(ids 0\.\.256\); set --model\.vocab_size to at least 901"):  # fmt: skip
        check_vocab(tmp_path / "m", 257)
    write_megatron(tmp_path / "s", [[np.array([1, -4, 9])]], 2)
    with pytest.raises(DataError, match=r"s\.bin \(int8\) holds token id -4; ids are 0 or more"):
        check_vocab(tmp_path / "s", 257)
    write_megatron(tmp_path / "f", [[np.array([1.0, 2.5, 3.0])]], 7)
    with pytest.raises(DataError, match=r"f\.bin \(float32\) holds 2\.5, which is not a token id"):
        check_vocab(tmp_path / "f", 257)
    write_megatron(tmp_path / "e", [], 8)
    check_vocab(tmp_path / "e", 257)  # nothing to check


def test_out_of_vocabulary_megatron_data_is_one_sentence_at_config_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mega_pretrain.cli import main

    write_megatron(tmp_path / "m", [[np.array([5, 7, 900, 3] * 50)]], 8)
    assert main(["--dry-run", "--data.paths", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert f"the token file {tmp_path / 'm'}.bin holds token id 900" in err
    assert "Traceback" not in err and err.count("\n") == 1
    assert (
        main(["--dry-run", "--data.paths", str(tmp_path / "m"), "--model.vocab_size", "1024"]) == 0
    )


def _as_megatron(mega_prefix: Path, prefix: Path, code: int = 8) -> None:
    """The documents of a mega file in Megatron's format, each cut into its lines (one
    sequence per line, as ``--split-sentences`` would keep sentences apart)."""
    source = IndexedTokenDataset(mega_prefix)
    docs = []
    for i in range(len(source)):
        doc = source.doc(i).astype(np.int64)
        cuts = np.flatnonzero(doc == ord("\n")) + 1
        docs.append(np.split(doc, cuts))
    write_megatron(prefix, docs, code)


def test_the_same_tokens_in_either_format_give_the_same_samples(tmp_path: Path) -> None:
    """The sampler's state (consumed samples) means the same data whatever the format: a
    Megatron copy of a mega file yields the same split, samples and blend, index by index."""
    rng = np.random.default_rng(11)
    docs = [rng.integers(0, 257, size=int(k)) for k in rng.integers(0, 80, size=60)]
    with IndexedTokenWriter(tmp_path / "a", 257) as writer:
        for doc in docs:
            writer.add_document(doc)
    _as_megatron(tmp_path / "a", tmp_path / "b", code=4)
    other = [rng.integers(0, 257, size=50) for _ in range(30)]
    with IndexedTokenWriter(tmp_path / "c", 257) as writer:
        for doc in other:
            writer.add_document(doc)

    def samples(prefix: Path) -> list[list[int]]:
        train, _ = split_train_valid(IndexedTokenDataset(prefix), 0.1, seed=5)
        blend = BlendedDataset(
            [
                (0.6, GPTDataset(train, 16, seed=5, num_samples=200)),
                (0.4, GPTDataset(IndexedTokenDataset(tmp_path / "c"), 16, seed=5, num_samples=200)),
            ],
            200,
            seed=5,
        )
        return [blend[i]["tokens"].tolist() for i in range(200)]

    assert samples(tmp_path / "b") == samples(tmp_path / "a")


COMMON = [
    ("train.steps", "10"), ("train.log_interval", "1"), ("train.seq_len", "32"),
    ("train.micro_batch_size", "2"), ("train.global_batch_size", "8"), ("train.eval_interval", "5"),
    ("train.eps", "1e-5"), ("run.tensorboard", "false"), ("checkpoint.save_interval", "0"),
]  # fmt: skip


def _prefixes(out_dir: str) -> tuple[Path, Path]:
    """A small default corpus in mega's format and its copy in Megatron's."""
    mega = ensure_default_dataset(Path(out_dir) / "cache", max_bytes=256 * 1024)
    megatron = Path(out_dir) / "megatron" / "corpus_text_document"
    if not Path(f"{megatron}.idx").exists():
        megatron.parent.mkdir(parents=True, exist_ok=True)
        _as_megatron(mega, megatron)
    return mega, megatron


def _train(out_dir: str, name: str, paths: str, extra: list[tuple[str, str]]) -> list[float]:
    from mega_pretrain.config import load_config
    from mega_pretrain.train import train

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mega, megatron = _prefixes(out_dir)
    chosen = {"mega": str(mega), "megatron": str(megatron), "both": f"{megatron},{mega}"}[paths]
    overrides = [*COMMON, ("run.out_dir", out_dir), ("run.name", name), ("data.paths", chosen)]
    return train(load_config(None, [*overrides, *extra])).losses


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def test_a_megatron_prefix_trains_unchanged(dist_pool: DistPool, tmp_path: Path) -> None:
    """The tiny model trained on a Megatron-format copy of a corpus: its loss falls, and
    every step equals the run on the mega-format original (bit for bit)."""
    megatron = dist_pool.run(_train, 1, args=(str(tmp_path), "megatron", "megatron", []))[0]
    mega = dist_pool.run(_train, 1, args=(str(tmp_path), "mega", "mega", []))[0]
    assert len(megatron) == 10 and megatron[-1] < megatron[0] - 0.5
    assert megatron == mega


def test_a_blend_of_both_formats_resumes_exactly(dist_pool: DistPool, tmp_path: Path) -> None:
    """A Megatron and a mega prefix blended: stopped after 5 steps and resumed, the run reads
    what a straight run reads (the checkpoint's data position holds across the formats)."""
    weights = [("data.weights", "0.7,0.3")]
    straight = dist_pool.run(_train, 1, args=(str(tmp_path), "straight", "both", weights))[0]
    stop = [*weights, ("train.exit_interval", "5")]
    assert len(dist_pool.run(_train, 1, args=(str(tmp_path), "resumed", "both", stop))[0]) == 5
    dist_pool.run(_train, 1, args=(str(tmp_path), "resumed", "both", weights))
    assert _losses(tmp_path / "resumed") == straight
    assert straight[-1] < straight[0]


def test_the_command_line_trains_on_a_megatron_prefix(tmp_path: Path) -> None:
    """`mega-pretrain --data.paths <Megatron prefix>`, no other flag: it trains."""
    _, megatron = _prefixes(str(tmp_path))
    flags = [f"--{key}={value}" for key, value in COMMON if key != "train.steps"]
    env = {**os.environ, "MEGA_PRETRAIN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(
        [sys.executable, "-m", "mega_pretrain", "--data.paths", str(megatron), "--train.steps",
         "3", "--run.name", "cli", *flags],
        cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(_losses(tmp_path / "runs/cli")) == 3
