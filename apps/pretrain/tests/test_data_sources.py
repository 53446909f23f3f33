"""preprocess from parquet, arrow and JSONL (plain and compressed): the same documents from
every format, the same tokens for any number of workers, resume after a stopped run, and bad
input in one sentence. The files are written in the tests with pyarrow and the stdlib."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from mega_pretrain.data import (
    ByteTokenizer,
    DataError,
    HFTokenizer,
    IndexedTokenDataset,
    preprocess,
)
from mega_pretrain.data.progress import ProgressLine
from mega_pretrain.data.sources import find_input_files, plan_pieces

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ALPHABET = "abc xyz\n\té東🚀{}\"'\\"


def _texts(seed: int, n: int) -> list[str | None]:
    """Random documents, some empty and (for the columnar formats) some null."""
    rnd = random.Random(seed)
    texts: list[str | None] = [
        "".join(rnd.choice(ALPHABET) for _ in range(rnd.randint(1, 60))) for _ in range(n)
    ]
    texts[3], texts[7] = "", None
    return texts


def _write_parquet(path: Path, texts: Sequence[str | None]) -> None:
    table = pa.table({"id": list(range(len(texts))), "text": list(texts)})
    pq.write_table(table, path, row_group_size=9)  # several row groups: several pieces


def _write_arrow(path: Path, texts: Sequence[str | None], *, file_format: bool = False) -> None:
    schema = pa.schema([("text", pa.large_string()), ("n", pa.int64())])
    with pa.OSFile(str(path), "wb") as sink:
        new = pa.ipc.new_file if file_format else pa.ipc.new_stream  # datasets writes streams
        with new(sink, schema) as writer:
            for i in range(0, len(texts), 11):
                chunk = list(texts[i : i + 11])
                writer.write_batch(
                    pa.record_batch(
                        [pa.array(chunk, pa.large_string()), pa.array(range(len(chunk)))],
                        schema=schema,
                    )
                )


def _jsonl_bytes(texts: Sequence[str | None]) -> bytes:
    lines = [json.dumps({"text": t or "", "meta": i}) for i, t in enumerate(texts)]
    return ("\n".join(lines) + "\n").encode()


def _write_zst(path: Path, data: bytes) -> None:
    with pa.output_stream(str(path), compression="zstd") as out:
        out.write(data)


WRITERS: dict[str, Callable[[Path, Sequence[str | None]], None]] = {
    "a.parquet": _write_parquet,
    "a.arrow": _write_arrow,
    "f.arrow": lambda p, t: _write_arrow(p, t, file_format=True),
    "a.jsonl": lambda p, t: p.write_bytes(_jsonl_bytes(t)),
    "a.jsonl.gz": lambda p, t: p.write_bytes(gzip.compress(_jsonl_bytes(t))),
    "a.jsonl.bz2": lambda p, t: p.write_bytes(bz2.compress(_jsonl_bytes(t))),
    "a.jsonl.xz": lambda p, t: p.write_bytes(lzma.compress(_jsonl_bytes(t))),
    "a.jsonl.zst": lambda p, t: _write_zst(p, _jsonl_bytes(t)),
    "a.json.gz": lambda p, t: p.write_bytes(gzip.compress(json.dumps([{"text": x or ""} for x in t]).encode())),
}  # fmt: skip


def _docs(prefix: Path) -> list[list[int]]:
    ds = IndexedTokenDataset(prefix)
    return [ds.doc(i).tolist() for i in range(len(ds))]


def _pair(prefix: Path) -> tuple[bytes, bytes]:
    return tuple(prefix.with_name(prefix.name + s).read_bytes() for s in (".bin", ".idx"))  # type: ignore[return-value]


def _bpe(tmp_path: Path, texts: Sequence[str | None]) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=120, special_tokens=["[UNK]", "<|endoftext|>"]
    )
    tok.train_from_iterator([t for t in texts if t], trainer)
    tok.save(str(tmp_path / "tok.json"))
    return tmp_path / "tok.json"


@pytest.mark.parametrize("name", list(WRITERS))
def test_each_format_round_trips(tmp_path: Path, name: str) -> None:
    texts = _texts(0, 40)
    WRITERS[name](tmp_path / name, texts)
    with pytest.warns(UserWarning, match=r"skipped 2 empty documents"):
        stats = preprocess(tmp_path / name, tmp_path / "o", "byte", progress=False, shard_bytes=300)
    tok = ByteTokenizer()
    assert _docs(tmp_path / "o") == [[*tok.encode(t), 256] for t in texts if t]
    assert (stats.documents, stats.skipped_empty, stats.files) == (38, 2, 1)
    assert stats.bytes == (tmp_path / name).stat().st_size
    assert not (tmp_path / "o.shards").exists()  # merged, then the shards are gone


def test_formats_and_worker_counts_give_the_same_tokens(tmp_path: Path) -> None:
    """Byte-level and a BPE: parquet, arrow and JSONL give one token file; 1 and 3 workers
    write the same bytes (the shards depend on the files alone, not on the workers)."""
    texts = _texts(1, 200)
    for name in ("a.parquet", "a.arrow", "a.jsonl", "a.jsonl.zst"):
        WRITERS[name](tmp_path / name, texts)
    bpe = f"hf:{_bpe(tmp_path, texts)}"
    for tokenizer in ("byte", bpe):
        pairs = {}
        for name in ("a.parquet", "a.arrow", "a.jsonl", "a.jsonl.zst"):
            for workers in (1, 3) if name in ("a.parquet", "a.jsonl") else (1,):
                out = tmp_path / f"{name}-{workers}-{tokenizer[:2]}"
                with pytest.warns(UserWarning, match="skipped"):
                    stats = preprocess(
                        tmp_path / name, out, tokenizer, workers=workers, shard_bytes=700,
                        progress=False,
                    )  # fmt: skip
                assert stats.workers == workers and (stats.shards > 3 or name == "a.jsonl.zst")
                pairs[out.name] = _pair(out)
        first = next(iter(pairs.values()))
        assert all(pair == first for pair in pairs.values()), list(pairs)
    hf = HFTokenizer(tmp_path / "tok.json")
    expected = [[*ids, hf.eod_id] for t in texts if t and (ids := hf.encode(t))]
    assert _docs(tmp_path / "a.parquet-3-hf") == expected
    assert sum(map(len, expected)) < sum(len(t.encode()) for t in texts if t)  # merges used


def test_a_folder_of_mixed_files_in_sorted_order_and_a_datasets_folder(tmp_path: Path) -> None:
    texts = _texts(2, 30)
    (tmp_path / "mix/b").mkdir(parents=True)
    WRITERS["a.jsonl.gz"](tmp_path / "mix/b/2.jsonl.gz", texts[:10])
    (tmp_path / "mix/a.txt").write_text("first")
    (tmp_path / "mix/b/1.jsonl").write_bytes(_jsonl_bytes(texts[10:]))
    (tmp_path / "mix/c.txt.gz").write_bytes(gzip.compress(b"not read"))  # other suffix: skipped
    found = [p.relative_to(tmp_path / "mix").as_posix() for p in find_input_files(tmp_path / "mix")]
    assert found == ["a.txt", "b/1.jsonl", "b/2.jsonl.gz"]
    # a `save_to_disk` folder: its .arrow files are the data, its JSON and README are not
    ds_dir = tmp_path / "saved"
    ds_dir.mkdir()
    _write_arrow(ds_dir / "data-00000-of-00002.arrow", texts[:15])
    _write_arrow(ds_dir / "data-00001-of-00002.arrow", texts[15:])
    (ds_dir / "dataset_info.json").write_text('{"features": {}}')
    (ds_dir / "state.json").write_text('{"_data_files": []}')
    (ds_dir / "README.md").write_text("# a dataset card")
    with pytest.warns(UserWarning, match="skipped 2 empty"):
        stats = preprocess(ds_dir, tmp_path / "o", "byte", progress=False)
    assert stats.files == 2
    assert _docs(tmp_path / "o") == [[*t.encode(), 256] for t in texts if t]


def test_plain_jsonl_is_cut_at_lines_and_reports_the_true_line_number(tmp_path: Path) -> None:
    texts = [f"document {i}" for i in range(100)]
    path = tmp_path / "d.jsonl"
    path.write_bytes(_jsonl_bytes(texts))
    pieces = plan_pieces([path], 256)
    assert len(pieces) > 10 and sum(p.nbytes for p in pieces) == path.stat().st_size
    preprocess(path, tmp_path / "o", "byte", progress=False, shard_bytes=256)
    assert _docs(tmp_path / "o") == [[*t.encode(), 256] for t in texts]
    lines = path.read_bytes().splitlines(keepends=True)
    lines[76] = b'{"text": "broken\n'
    path.write_bytes(b"".join(lines))
    with pytest.raises(DataError, match=r"^line 77 of .*d\.jsonl is not valid JSON: "):
        preprocess(path, tmp_path / "o2", "byte", progress=False, shard_bytes=256)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "o.bin", "o.idx"]


class _StoppingTokenizer:
    """Byte ids through the generic (not the byte fast) path, recording the documents it
    encodes; raises KeyboardInterrupt at the document ``stop_at`` (a Ctrl-C mid-run)."""

    vocab_size = 257
    eod_id = 256

    def __init__(self) -> None:
        self.encoded: list[str] = []
        self.stop_at: str | None = None

    def encode(self, text: str) -> list[int]:
        if text == self.stop_at:
            raise KeyboardInterrupt
        self.encoded.append(text)
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i != 256).decode()

    def __repr__(self) -> str:
        return "_StoppingTokenizer()"


def test_a_stopped_run_resumes_from_its_complete_shards(tmp_path: Path) -> None:
    texts = [f"doc {i:03d} " + "x" * (i % 7) for i in range(60)]
    path = tmp_path / "d.jsonl"
    path.write_bytes(_jsonl_bytes(texts))
    tok = _StoppingTokenizer()
    tok.stop_at = "doc 040 xxxxx"
    with pytest.raises(KeyboardInterrupt):
        preprocess(path, tmp_path / "o", tok, progress=False, shard_bytes=200)
    shards = tmp_path / "o.shards"
    done = sorted(p.name for p in shards.glob("shard-*.json"))
    assert len(done) >= 3 and not (tmp_path / "o.bin").exists()
    assert not list(shards.glob("*.tmp-*"))  # the interrupted shard's temp files were removed
    # a kill leaves temp files and no record: that shard is redone, the others are kept
    last = done[-1].removesuffix(".json")
    for leftover in (f"{last}.json", f"{last}.idx"):
        (shards / leftover).unlink()
    (shards / f"{last}.idx.tmp-99-dead").write_bytes(b"half")
    tok.stop_at = None
    tok.encoded.clear()
    stats = preprocess(path, tmp_path / "o", tok, progress=False, shard_bytes=200)
    assert (stats.resumed, stats.documents) == (len(done) - 1, 60)
    kept = sum(1 for t in texts if t not in tok.encoded)  # the kept shards' documents
    assert kept > 0 and tok.encoded == texts[kept:]
    assert _docs(tmp_path / "o") == [[*t.encode(), 256] for t in texts]
    assert not shards.exists()
    # the same tokens as one straight run; a changed input starts the shards anew
    straight = preprocess(path, tmp_path / "s", "byte", progress=False, shard_bytes=200)
    assert _pair(tmp_path / "s") == _pair(tmp_path / "o") and straight.resumed == 0


def test_a_stale_shard_folder_from_other_settings_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(_jsonl_bytes(["one", "two"]))
    shards = tmp_path / "o.shards"
    shards.mkdir()
    (shards / "plan.json").write_text('{"version": 0}')
    (shards / "shard-000000.json").write_text('{"documents": 5, "tokens": 9}')
    stats = preprocess(path, tmp_path / "o", "byte", progress=False)
    assert stats.resumed == 0 and _docs(tmp_path / "o") == [[*b"one", 256], [*b"two", 256]]


def test_ids_past_65535_are_stored_wide_from_parquet(tmp_path: Path) -> None:
    import base64

    from mega_pretrain.data import TiktokenTokenizer

    ranks = b"\n".join(base64.b64encode(bytes([b])) + b" %d" % b for b in range(256))
    (tmp_path / "t.tiktoken").write_bytes(ranks)
    tok = TiktokenTokenizer(tmp_path / "t.tiktoken", special_tokens={"<|endoftext|>": 70_000})
    _write_parquet(tmp_path / "a.parquet", ["ab", "c"])
    preprocess(tmp_path / "a.parquet", tmp_path / "o", tok, progress=False, workers=2)
    ds = IndexedTokenDataset(tmp_path / "o")
    assert ds.header.dtype.name == "int32"
    assert _docs(tmp_path / "o") == [[97, 98, 70_000], [99, 70_000]]


@pytest.mark.parametrize(
    ("name", "write", "message"),
    [
        (
            "a.parquet",
            lambda p: pq.write_table(pa.table({"body": ["x"], "id": [1]}), p),
            r"a\.parquet has no column 'text'; its columns are 'body', 'id'; name the column "
            r"that holds the text with --text-key \(jsonl_key= in Python\)$",
        ),
        (
            "a.arrow",
            lambda p: _write_arrow_ints(p),
            r"column 'text' of .*a\.arrow holds int64, not strings; name a text column$",
        ),
        (
            "a.parquet",
            lambda p: p.write_bytes(b"PAR1 not really"),
            r"cannot read .*a\.parquet as Parquet \(.*\); give a file written by pyarrow",
        ),
        (
            "empty/",
            lambda p: p.mkdir(),
            r"no documents found in .*empty; give \.txt, \.md or \.py files .*\.parquet or "
            r"\.arrow files \(one document per row\) or folders holding them$",
        ),
        (
            "a.txt.gz",
            lambda p: p.write_bytes(gzip.compress(b"x")),
            r"cannot tell the type of .*a\.txt\.gz from its suffix '\.gz'; use \.txt, .* "
            r"\.parquet, \.arrow \(one document per row\)$",
        ),
        (
            "a.jsonl.gz",
            lambda p: p.write_bytes(gzip.compress(b'{"text": "a"}\n{"text": 1}\n')),
            r"^line 2 of .*a\.jsonl\.gz holds a JSON number in 'text', not a string$",
        ),
    ],
)
def test_bad_input_is_one_sentence_and_leaves_nothing(
    tmp_path: Path, name: str, write: Callable[[Path], None], message: str
) -> None:
    write(tmp_path / name.rstrip("/"))
    with pytest.raises(DataError, match=message) as info:
        preprocess(tmp_path / name.rstrip("/"), tmp_path / "out/o", "byte", progress=False)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def _write_arrow_ints(path: Path) -> None:
    with (
        pa.OSFile(str(path), "wb") as sink,
        pa.ipc.new_stream(sink, pa.schema([("text", pa.int64())])) as w,
    ):
        w.write_batch(pa.record_batch([pa.array([1, 2])], names=["text"]))  # fmt: skip


def test_a_workers_bad_line_is_the_same_sentence(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"d{i}"}) for i in range(40)]
    lines[33] = '{"txt": "no text"}'
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"^line 34 of .*d\.jsonl has no field 'text'; its "):
        preprocess(tmp_path / "d.jsonl", tmp_path / "o", workers=2, shard_bytes=100, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]  # no shards left


def test_without_pyarrow_jsonl_still_reads_and_parquet_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_parquet(tmp_path / "a.parquet", ["x"])
    WRITERS["a.jsonl.xz"](tmp_path / "a.jsonl.xz", ["x", "yz"])
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now fails
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    preprocess(tmp_path / "a.jsonl.xz", tmp_path / "o", progress=False)
    assert _docs(tmp_path / "o") == [[120, 256], [121, 122, 256]]
    with pytest.raises(ImportError, match=r"^reading .*a\.parquet needs pyarrow, which is not "
                       r"installed; install it with `pip install 'mega-pretrain\[hf-data\]'`$"):  # fmt: skip
        preprocess(tmp_path / "a.parquet", tmp_path / "o", progress=False)


def test_bad_worker_count_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^workers \(0\) must be a whole number of processes"):
        preprocess(tmp_path, tmp_path / "o", workers=0)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_line_redraws_on_a_terminal_and_is_sparse_in_a_log() -> None:
    log = io.StringIO()
    line = ProgressLine(3, 5, stream=log, log_interval=3600)
    for _ in range(1000):
        line.advance(documents=1, tokens=10)
    line.close()
    assert log.getvalue() == ""  # a log gets no line within the interval (the summary follows)
    tty = _Terminal()
    line = ProgressLine(3, 5, stream=tty)
    line.advance(documents=2, tokens=30, shards=1, files=1)
    line.close()
    text = tty.getvalue()
    assert text.startswith("\rpreprocess: 1/3 files, 1/5 shards, 2 documents, 30 tokens, ")
    assert text.endswith(" tokens/s\x1b[K\n") and text.count("\n") == 1


def test_the_printed_data_paths_trains(tmp_path: Path) -> None:
    """`mega-pretrain preprocess <parquet folder> --workers 2`, then the `--data.paths` it
    printed: the tiny model trains on it for 3 steps."""
    import os
    import subprocess

    (tmp_path / "ds").mkdir()
    for i in range(3):
        _write_parquet(
            tmp_path / f"ds/part-{i}.parquet", [f"document {i} {j} " * 30 for j in range(20)]
        )
    env = {**os.environ, "MEGA_PRETRAIN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "mega_pretrain", *args], cwd=tmp_path, env=env, text=True,
            capture_output=True, timeout=300, check=False,
        )  # fmt: skip

    done = run("preprocess", "ds", "--output", "data/ds", "--workers", "2", "--text-key", "text",
               "--shard-mb", "0.002")  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = done.stdout.strip()
    assert summary.startswith("wrote 60 documents, ") and " shards, 2 workers)" in summary
    paths = summary.rsplit("--data.paths ", 1)[1]
    assert paths == "data/ds"
    done = run("--data.paths", paths, "--train.steps", "3", "--train.log_interval", "1",
               "--run.name", "hf", "--run.tensorboard", "false")  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [json.loads(x) for x in (tmp_path / "runs/hf/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]
    assert np.isfinite([r["loss"] for r in records if r["kind"] == "train"]).all()


class _DyingTokenizer(_StoppingTokenizer):
    """Exits its process at the document ``stop_at``, as a worker killed by the OOM killer."""

    def encode(self, text: str) -> list[int]:
        if text == self.stop_at:
            import os

            os._exit(9)
        return list(text.encode("utf-8"))


def test_a_dead_worker_stops_the_run_and_its_complete_shards_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the spawned workers unpickle the tokenizer by its module: make this file importable
    # there under a plain name (pytest imports it under its path's dotted name)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.setitem(sys.modules, "test_data_sources", sys.modules[__name__])
    monkeypatch.setattr(_DyingTokenizer, "__module__", "test_data_sources")
    texts = [f"doc {i:03d}" for i in range(60)]
    (tmp_path / "d.jsonl").write_bytes(_jsonl_bytes(texts))
    tok = _DyingTokenizer()
    tok.stop_at = "doc 055"
    with pytest.raises(RuntimeError, match=r"^preprocess worker preprocess-\d exited \(code 9\) "
                       r"with \d+ shards unwritten \(.*\); run the same command again to resume"):  # fmt: skip
        preprocess(tmp_path / "d.jsonl", tmp_path / "o", tok, workers=2, shard_bytes=200,
                   progress=False)  # fmt: skip
    assert list((tmp_path / "o.shards").glob("shard-*.json"))  # kept for the rerun
    tok.stop_at = None
    stats = preprocess(tmp_path / "d.jsonl", tmp_path / "o", tok, shard_bytes=200, progress=False)
    assert stats.resumed > 0 and _docs(tmp_path / "o") == [[*t.encode(), 256] for t in texts]
