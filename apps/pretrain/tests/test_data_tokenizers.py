"""Tokenizers round-trip text exactly; the optional ones read local files and fail clearly."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest

from mega_pretrain.data import (
    ByteTokenizer,
    DataError,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    build_tokenizer,
)

TEXTS = [
    "hello world",
    "def f(x):\n    return x  # comment\n\n",
    "naïve café, 東京, Ελληνικά, emoji 🚀🙂, tab\tend",
    "  leading and trailing spaces  ",
    "",
]


def test_byte_tokenizer_round_trips_utf8_exactly() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eod_id) == (257, 256)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
        assert tok.decode([*ids, tok.eod_id]) == text  # the end-of-document id decodes to nothing


def test_byte_tokenizer_rejects_ids_outside_its_vocabulary() -> None:
    with pytest.raises(ValueError, match=r"token id 257 is outside the byte vocabulary") as info:
        ByteTokenizer().decode([1, 257])
    assert "\n" not in str(info.value)


def _tiny_hf_tokenizer(path: Path) -> Path:
    """Train a tiny byte-level BPE in memory and save it as tokenizer.json."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 20, trainer)
    tok.save(str(path))
    return path


def test_hf_tokenizer_round_trips(tmp_path: Path) -> None:
    path = _tiny_hf_tokenizer(tmp_path / "tokenizer.json")
    tok = HFTokenizer(path)
    assert isinstance(tok, Tokenizer)
    assert tok.eod_token == "<|endoftext|>"
    assert 256 < tok.vocab_size <= 320
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.eod_id not in ids
        assert tok.decode([*ids, tok.eod_id]) == text
    assert len(tok.encode("hello world")) < len("hello world")  # merges were learned
    # a folder holding tokenizer.json and the spec string name the same tokenizer
    assert HFTokenizer(tmp_path).encode(TEXTS[2]) == tok.encode(TEXTS[2])
    assert build_tokenizer(f"hf:{path}").encode(TEXTS[1]) == tok.encode(TEXTS[1])


def _tiny_tiktoken_file(path: Path) -> Path:
    """A .tiktoken BPE file: the 256 bytes, then a few merges, as base64 token + rank."""
    merges = [b"th", b"the", b" t", b" the", b"in", b"ing"]
    tokens = [bytes([b]) for b in range(256)] + merges
    lines = [base64.b64encode(t) + b" " + str(rank).encode() for rank, t in enumerate(tokens)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_tiktoken_tokenizer_round_trips(tmp_path: Path) -> None:
    tok = TiktokenTokenizer(_tiny_tiktoken_file(tmp_path / "tiny.tiktoken"))
    assert isinstance(tok, Tokenizer)
    assert (tok.eod_id, tok.vocab_size) == (262, 263)  # eod numbered after the largest rank
    # ranks: th 256, the 257, " t" 258, " the" 259, in 260, ing 261; merges go lowest rank first
    assert tok.encode("the") == [257]
    assert tok.encode(" the") == [259]
    assert tok.encode("the thing") == [257, ord(" "), 256, 261]
    for text in [*TEXTS, "<|endoftext|> in a document is plain text"]:
        ids = tok.encode(text)
        assert tok.eod_id not in ids
        assert tok.decode([*ids, tok.eod_id]) == text
    assert build_tokenizer(f"tiktoken:{tmp_path / 'tiny.tiktoken'}").encode("the") == [257]


def test_tiktoken_file_named_like_a_published_encoding_gets_its_special_tokens(
    tmp_path: Path,
) -> None:
    tok = TiktokenTokenizer(_tiny_tiktoken_file(tmp_path / "cl100k_base.tiktoken"))
    assert tok.eod_id == 100257
    assert tok.decode(tok.encode(TEXTS[2])) == TEXTS[2]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: build_tokenizer("bytes"), r"unknown tokenizer 'bytes'; use 'byte', 'hf:"),
        (lambda p: build_tokenizer("hf:"), r"unknown tokenizer 'hf:'"),
        (lambda p: build_tokenizer("spm:model.bin"), r"unknown tokenizer 'spm:model.bin'"),
        (lambda p: HFTokenizer(p / "nope.json"), r"tokenizer file .*nope.json does not exist"),
        (lambda p: TiktokenTokenizer(p), r"tiktoken BPE path .* is not a file"),
        (
            lambda p: HFTokenizer(_write(p / "t.json", b"{not json")),
            r"cannot read .*t.json as a Hugging Face tokenizer",
        ),
        (
            lambda p: TiktokenTokenizer(_write(p / "b.tiktoken", b"dGg= 0\nnot-base64!! 1\n")),
            r"line 2 of .*b.tiktoken is not '<base64 token> <rank>'",
        ),
        (
            lambda p: TiktokenTokenizer(_write(p / "e.tiktoken", b"\n")),
            r"e.tiktoken holds no tokens",
        ),
        (
            lambda p: TiktokenTokenizer(
                _tiny_tiktoken_file(p / "t.tiktoken"),
                special_tokens={"<|endoftext|>": 262},
                eod_token="</s>",
            ),
            r"eod_token '</s>' is not among the special tokens",
        ),
        (
            lambda p: HFTokenizer(_tiny_hf_tokenizer(p / "tokenizer.json"), eod_token="</s>"),
            r"has no end-of-document token \(looked for </s>\); pass eod_token=",
        ),
    ],
)
def test_bad_tokenizer_input_raises_one_sentence(
    tmp_path: Path, make: object, message: str
) -> None:
    with pytest.raises(DataError, match=message) as info:
        make(tmp_path)  # type: ignore[operator]
    assert "\n" not in str(info.value)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("module", "cls", "extra"),
    [("tokenizers", HFTokenizer, "tokenizers"), ("tiktoken", TiktokenTokenizer, "tiktoken")],
)
def test_missing_optional_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, cls: type, extra: str
) -> None:
    path = _write(tmp_path / "file", b"x")
    monkeypatch.setitem(sys.modules, module, None)  # makes `import <module>` fail
    with pytest.raises(
        ImportError, match=rf"needs the '{module}' package.*mega-pretrain\[{extra}\]"
    ):
        cls(path)
