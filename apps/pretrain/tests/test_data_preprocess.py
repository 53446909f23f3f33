"""preprocess: tokens in = tokens out, document boundaries kept, and bad input in one sentence."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from mega_pretrain.data import (
    ByteTokenizer,
    DataError,
    IndexedTokenDataset,
    TiktokenTokenizer,
    default_corpus,
    ensure_default_dataset,
    find_input_files,
    preprocess,
)

ALPHABET = "abc xyz\n\té東🚀{}\"'\\"


def _random_texts(seed: int, n: int) -> list[str]:
    rnd = random.Random(seed)
    return ["".join(rnd.choice(ALPHABET) for _ in range(rnd.randint(1, 80))) for _ in range(n)]


def test_text_and_jsonl_round_trip_with_boundaries(tmp_path: Path) -> None:
    texts = _random_texts(0, 30)
    (tmp_path / "a.txt").write_text(texts[0], encoding="utf-8")
    with open(tmp_path / "b.jsonl", "w", encoding="utf-8") as f:
        for text in texts[1:20]:
            f.write(json.dumps({"id": 1, "body": text}, ensure_ascii=len(text) % 2 == 0) + "\n")
        f.write("\n")  # blank lines are not documents
    (tmp_path / "c.json").write_text(json.dumps([{"body": t} for t in texts[20:]], indent=2))
    tok = ByteTokenizer()
    inputs = [tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.json"]
    stats = preprocess(inputs, tmp_path / "out" / "c", tok, jsonl_key="body", progress=False)
    ds = IndexedTokenDataset(tmp_path / "out" / "c")
    assert (stats.files, stats.documents, len(ds), ds.eod_id) == (3, 30, 30, 256)
    expected = [[*tok.encode(t), tok.eod_id] for t in texts]
    for i, text in enumerate(texts):
        assert ds.doc(i).tolist() == expected[i]  # tokens in = tokens out, one per document
        assert tok.decode(ds.doc(i).tolist()) == text
    assert stats.tokens == ds.num_tokens == sum(map(len, expected))
    assert stats.bytes == sum(p.stat().st_size for p in inputs)
    # without end-of-document tokens the stored documents are exactly the encoded texts
    preprocess(inputs, tmp_path / "plain", tok, jsonl_key="body", append_eod=False, progress=False)
    plain = IndexedTokenDataset(tmp_path / "plain")
    assert plain.eod_id is None
    assert [plain.doc(i).tolist() for i in range(30)] == [tok.encode(t) for t in texts]


def test_folder_is_read_recursively_in_sorted_order(tmp_path: Path) -> None:
    files = {
        "b/2.md": "second",
        "b/10.py": "print(1)",
        "a.txt": "first",
        "c/d/e.jsonl": '{"text": "deep"}\n{"text": "deeper"}\n',
        "c/skip.csv": "x,y",
        ".hidden/x.txt": "hidden",
    }
    for name, text in files.items():
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_text(text)
    found = [p.relative_to(tmp_path / "in").as_posix() for p in find_input_files(tmp_path / "in")]
    assert found == ["a.txt", "b/10.py", "b/2.md", "c/d/e.jsonl"]
    preprocess(tmp_path / "in", tmp_path / "c", "byte", progress=True)  # the bar draws
    ds = IndexedTokenDataset(tmp_path / "c")
    got = [ByteTokenizer().decode(ds.doc(i).tolist()) for i in range(len(ds))]
    assert got == ["first", "print(1)", "second", "deep", "deeper"]


def test_empty_documents_are_skipped_and_counted(tmp_path: Path) -> None:
    (tmp_path / "e.txt").write_text("")
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n{"text": ""}\n{"text": "yz"}\n')
    with pytest.warns(UserWarning, match=r"skipped 2 empty documents"):
        stats = preprocess(
            [tmp_path / "e.txt", tmp_path / "d.jsonl"], tmp_path / "c", "byte", progress=False
        )
    assert (stats.documents, stats.skipped_empty) == (2, 2)
    ds = IndexedTokenDataset(tmp_path / "c")
    assert [ds.doc(0).tolist(), ds.doc(1).tolist()] == [[120, 256], [121, 122, 256]]


def test_tiktoken_preprocess_uses_int32_only_when_needed(tmp_path: Path) -> None:
    import base64

    ranks = b"\n".join(base64.b64encode(bytes([b])) + b" %d" % b for b in range(256))
    (tmp_path / "t.tiktoken").write_bytes(ranks)
    (tmp_path / "x.txt").write_text("some text")
    tok = TiktokenTokenizer(tmp_path / "t.tiktoken", special_tokens={"<|endoftext|>": 99_999})
    preprocess(tmp_path / "x.txt", tmp_path / "c", tok, progress=False)
    ds = IndexedTokenDataset(tmp_path / "c")
    assert (ds.header.dtype.name, ds.vocab_size) == ("int32", 100_000)
    assert ds.doc(0).tolist() == [*b"some text", 99_999]


def _inputs(tmp_path: Path, name: str, content: bytes) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty/", None, r"no documents found in .*empty; give \.txt, \.md or \.py files"),
        ("e.jsonl", b"\n\n", r"no documents found in .*e\.jsonl; give"),
        ("e.txt", b"", r"no documents found in .*e\.txt \(all 1 were empty\); give"),
        (
            "data.jsonl",
            b'{"text": "a"}\n' * 16 + b"{'text': 'single quotes'}\n",
            r"line 17 of .*data\.jsonl is not valid JSON: Expecting property name enclosed in "
            r"double quotes \(column 2\)$",
        ),
        (
            "data.jsonl",
            b'{"text": "a"}\n{"text": "b"}\n{"body": "c", "id": 3}\n',
            r"line 3 of .*data\.jsonl has no field 'text'; its fields are 'body', 'id'; "
            r"name the field that holds the text with --jsonl-key \(jsonl_key= in Python\)$",
        ),
        (
            "data.jsonl",
            b'["text", "a list"]\n',
            r"line 1 of .*data\.jsonl is a JSON array, not an object with a field 'text'",
        ),
        (
            "data.jsonl",
            b'{"text": 42}\n',
            r"line 1 of .*data\.jsonl holds a JSON number in 'text', not a string$",
        ),
        (
            "data.jsonl",
            b'{"text": "\xff"}\n',
            r"line 1 of .*data\.jsonl is not valid UTF-8 \(invalid start byte at byte 10\)$",
        ),
        (
            "arr.json",
            b'[{"text": "a"}, {"txt": "b"}]',
            r"item 2 of .*arr\.json has no field 'text'",
        ),
        ("bad.json", b"[1, 2", r"bad\.json is not valid JSON: Expecting ',' delimiter \(line 1"),
        ("latin.txt", b"caf\xe9!", r"latin\.txt is not valid UTF-8 text \(invalid continuation"),
        ("data.csv", b"a,b", r"cannot tell the type of .*data\.csv from its suffix '\.csv'; use"),
        ("missing.txt", None, r"input .*missing\.txt does not exist; check the path$"),
    ],
)
def test_bad_input_raises_one_sentence_and_writes_nothing(
    tmp_path: Path, name: str, content: bytes | None, message: str
) -> None:
    if name.endswith("/"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.csv").write_text("ignored")
        path = tmp_path / name
    elif content is None:
        path = tmp_path / name
    else:
        path = _inputs(tmp_path, name, content)
    with pytest.raises(DataError, match=message) as info:
        preprocess(path, tmp_path / "out" / "c", "byte", progress=False)
    assert "\n" not in str(info.value)
    out = tmp_path / "out"
    assert not out.exists() or not any(out.iterdir())  # no pair, no temp files


def test_bad_tokenizer_spec_is_reported_before_reading(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"unknown tokenizer 'gpt2'"):
        preprocess(tmp_path, tmp_path / "c", "gpt2", progress=False)


def test_default_corpus_is_bounded_and_deterministic(tmp_path: Path) -> None:
    files = default_corpus(max_bytes=300_000, max_files=40)
    assert files == default_corpus(max_bytes=300_000, max_files=40)
    assert 0 < len(files) <= 40
    assert sum(p.stat().st_size for p in files) <= 300_000
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in files)
    assert len({p.parent for p in files}) > 1  # spread over the library, not one folder

    prefix = ensure_default_dataset(tmp_path, max_bytes=300_000, max_files=40)
    ds = IndexedTokenDataset(prefix)
    assert len(ds) == len(files) and ds.vocab_size == 257
    assert ByteTokenizer().decode(ds.doc(0).tolist()) == files[0].read_text(encoding="utf-8")
    stamp = (prefix.with_name(prefix.name + ".bin")).stat().st_mtime_ns
    assert ensure_default_dataset(tmp_path, max_bytes=300_000, max_files=40) == prefix  # reused
    assert (prefix.with_name(prefix.name + ".bin")).stat().st_mtime_ns == stamp
    idx = prefix.with_name(prefix.name + ".idx")
    idx.write_bytes(idx.read_bytes()[:-8])  # a damaged cache entry is rebuilt
    assert ensure_default_dataset(tmp_path, max_bytes=300_000, max_files=40) == prefix
    np.testing.assert_array_equal(IndexedTokenDataset(prefix).doc(0), ds.doc(0))
