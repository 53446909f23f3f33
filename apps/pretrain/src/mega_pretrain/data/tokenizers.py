"""Tokenizers: byte-level (built in), Hugging Face ``tokenizers`` JSON files, tiktoken BPE files.

Every tokenizer turns one document's text into token ids and back, and names the id that ends
a document (``eod_id``). The optional libraries are imported only when their tokenizer is
built, and nothing is ever downloaded: the files are local.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from mega_pretrain.data.errors import DataError

if TYPE_CHECKING:
    import tiktoken
    import tokenizers

__all__ = ["ByteTokenizer", "HFTokenizer", "TiktokenTokenizer", "Tokenizer", "build_tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What preprocessing and sampling need from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids (every id is in ``range(vocab_size)``)."""

    @property
    def eod_id(self) -> int:
        """The id appended after each document."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without any special token."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; the end-of-document id decodes to nothing."""


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus the end-of-document token 256: vocabulary 257.

    Needs no file and round-trips any text exactly; it is the default, and matches the
    ``tiny`` model's vocabulary.
    """

    vocab_size: int = 257
    eod_id: int = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the byte vocabulary (0..256)")
        # A window cut from a document may split a multi-byte character: replace, do not fail.
        return bytes(i for i in ids if i != self.eod_id).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


# Names that Hugging Face tokenizers commonly give their end-of-document token, in the order
# they are looked for when no ``eod_token`` is given.
_HF_EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")


def _existing_file(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise DataError(f"{what} file {path} does not exist; check the path")
    if not path.is_file():
        raise DataError(f"{what} path {path} is not a file; give the file itself")
    return path


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file (``tokenizer.json``), read locally.

    ``path`` may name the JSON file or a folder holding ``tokenizer.json``. The end-of-document
    token is ``eod_token`` when given, else the first of ``<|endoftext|>``, ``<|end_of_text|>``,
    ``</s>``, ``<eos>``, ``<|eos|>``, ``[EOS]`` that the vocabulary holds. Needs the
    ``tokenizers`` extra.
    """

    def __init__(self, path: str | Path, *, eod_token: str | None = None) -> None:
        if Path(path).is_dir():
            path = Path(path) / "tokenizer.json"
        self.path = _existing_file(path, "tokenizer")
        try:
            import tokenizers
        except ImportError:
            raise ImportError(
                "HFTokenizer needs the 'tokenizers' package; install it with "
                "`pip install 'mega-pretrain[tokenizers]'`"
            ) from None
        try:
            self._tok: tokenizers.Tokenizer = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as exc:  # the Rust side raises a bare Exception
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DataError(
                f"cannot read {self.path} as a Hugging Face tokenizer ({reason}); "
                "give a tokenizer.json saved by the tokenizers library"
            ) from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        names = (eod_token,) if eod_token is not None else _HF_EOD_NAMES
        found = [name for name in names if name in vocab]
        if not found:
            raise DataError(
                f"tokenizer {self.path} has no end-of-document token "
                f"(looked for {', '.join(names)}); pass eod_token= naming one it has"
            )
        self.eod_token = found[0]
        self._eod_id = vocab[self.eod_token]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod_id(self) -> int:
        return self._eod_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([i for i in ids if i != self._eod_id]))

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, eod_token={self.eod_token!r})"


# Split patterns and special tokens of the published tiktoken encodings, so that a local copy
# of their .tiktoken file (named as published) tokenizes exactly as tiktoken itself does.
_GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
_CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++"""
    r"""[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
_EOT = "<|endoftext|>"
_KNOWN_TIKTOKEN: dict[str, tuple[str, dict[str, int]]] = {
    "r50k_base": (_GPT2_PATTERN, {_EOT: 50256}),
    "p50k_base": (_GPT2_PATTERN, {_EOT: 50256}),
    "cl100k_base": (
        _CL100K_PATTERN,
        {
            _EOT: 100257,
            "<|fim_prefix|>": 100258,
            "<|fim_middle|>": 100259,
            "<|fim_suffix|>": 100260,
            "<|endofprompt|>": 100276,
        },
    ),
    "o200k_base": (_O200K_PATTERN, {_EOT: 199999, "<|endofprompt|>": 200018}),
}


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a .tiktoken file: one ``<base64 token> <rank>`` per line.

    Read here rather than with ``tiktoken.load.load_tiktoken_bpe``, which copies every path it
    reads into a cache keyed by the path alone and would serve a stale copy after the file at
    that path changes.
    """
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except (ValueError, binascii.Error):
            raise DataError(
                f"line {number} of {path} is not '<base64 token> <rank>'; give a .tiktoken BPE file"
            ) from None
    if not ranks:
        raise DataError(f"{path} holds no tokens; give a .tiktoken BPE file")
    return ranks


class TiktokenTokenizer:
    """A tiktoken BPE encoding read from a local ``.tiktoken`` file (never downloaded).

    A file named after a published encoding (``cl100k_base.tiktoken``, ``o200k_base.tiktoken``,
    ``r50k_base.tiktoken``, ``p50k_base.tiktoken``) gets that encoding's split pattern and
    special tokens; any other file gets the GPT-2 pattern and ``eod_token`` as one special token
    numbered after the largest rank, unless ``pattern``/``special_tokens`` say otherwise.
    Special-token text inside documents is encoded as ordinary text. Needs the ``tiktoken``
    extra.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        pattern: str | None = None,
        special_tokens: dict[str, int] | None = None,
        eod_token: str = _EOT,
    ) -> None:
        self.path = _existing_file(path, "tiktoken BPE")
        try:
            import tiktoken
        except ImportError:
            raise ImportError(
                "TiktokenTokenizer needs the 'tiktoken' package; install it with "
                "`pip install 'mega-pretrain[tiktoken]'`"
            ) from None
        ranks = _read_tiktoken_ranks(self.path)
        known = _KNOWN_TIKTOKEN.get(self.path.stem)
        if pattern is None:
            pattern = known[0] if known else _GPT2_PATTERN
        if special_tokens is None:
            special_tokens = dict(known[1]) if known else {eod_token: max(ranks.values()) + 1}
        if eod_token not in special_tokens:
            raise DataError(
                f"eod_token {eod_token!r} is not among the special tokens of {self.path} "
                f"({', '.join(special_tokens)}); pass eod_token= naming one of them"
            )
        self.eod_token = eod_token
        self._eod_id = special_tokens[eod_token]
        self._enc: tiktoken.Encoding = tiktoken.Encoding(
            name=self.path.stem,
            pat_str=pattern,
            mergeable_ranks=ranks,
            special_tokens=special_tokens,
        )

    @property
    def vocab_size(self) -> int:
        return int(self._enc.n_vocab)

    @property
    def eod_id(self) -> int:
        return self._eod_id

    def encode(self, text: str) -> list[int]:
        return list(self._enc.encode_ordinary(text))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._enc.decode([i for i in ids if i != self._eod_id]))

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({str(self.path)!r}, eod_token={self.eod_token!r})"


def build_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer a spec string names: ``byte``, ``hf:PATH`` or ``tiktoken:PATH``.

    >>> build_tokenizer("byte").vocab_size
    257
    """
    kind, sep, path = spec.partition(":")
    kind = kind.strip().lower()
    if kind == "byte" and not sep:
        return ByteTokenizer()
    if kind in ("hf", "tiktoken") and path:
        return HFTokenizer(path) if kind == "hf" else TiktokenTokenizer(path)
    raise DataError(
        f"unknown tokenizer {spec!r}; use 'byte', 'hf:/path/tokenizer.json' "
        "or 'tiktoken:/path/file.tiktoken'"
    )
