"""Token sources: a sequence of documents that can be read as one concatenated stream.

:class:`~mega_pretrain.data.IndexedTokenDataset` is one; :class:`DocumentSubset` (some of its
documents, e.g. the validation split) is another. ``GPTDataset`` reads either.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = ["DocumentSubset", "TokenSource"]


@runtime_checkable
class TokenSource(Protocol):
    """Documents of token ids, readable as windows of their concatenation."""

    def __len__(self) -> int:
        """Number of documents."""

    @property
    def num_tokens(self) -> int:
        """Tokens in all documents together."""

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary the ids were written for; None when the file does not record it."""

    @property
    def eod_id(self) -> int | None:
        """The id that ends each document, or None when none was appended."""

    @property
    def doc_offsets(self) -> npt.NDArray[np.int64]:
        """Where each document starts in the concatenation, and where the last ends: ``[len + 1]``."""

    def doc(self, i: int) -> npt.NDArray[Any]:
        """Token ids of document ``i``."""

    def tokens(self, start: int, length: int) -> npt.NDArray[Any]:
        """``length`` ids of the concatenation of all documents, from ``start``."""


class DocumentSubset:
    """The documents ``doc_ids`` of ``source``, in that order, as a token source of their own.

    Only the document ids and their cumulative lengths are kept (``int64`` each); the tokens
    are read from ``source`` when asked for.
    """

    def __init__(self, source: TokenSource, doc_ids: npt.ArrayLike) -> None:
        ids = np.asarray(doc_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= len(source)):
            raise IndexError(f"document ids must be in 0..{len(source) - 1} for this source")
        self.source = source
        self.doc_ids = ids
        source_offsets = np.asarray(source.doc_offsets, dtype=np.int64)
        self._source_starts = source_offsets[ids]
        lengths = source_offsets[ids + 1] - self._source_starts
        self._offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])

    def __len__(self) -> int:
        return int(self.doc_ids.size)

    @property
    def num_tokens(self) -> int:
        return int(self._offsets[-1])

    @property
    def vocab_size(self) -> int | None:
        return self.source.vocab_size

    @property
    def eod_id(self) -> int | None:
        return self.source.eod_id

    @property
    def doc_offsets(self) -> npt.NDArray[np.int64]:
        return self._offsets

    def doc(self, i: int) -> npt.NDArray[Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} is out of range for {len(self)} documents")
        return self.source.doc(int(self.doc_ids[i]))

    def tokens(self, start: int, length: int) -> npt.NDArray[Any]:
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(
                f"tokens [{start}, {start + length}) are out of range for {self.num_tokens} tokens"
            )
        pieces = [self.source.tokens(0, 0)]  # keeps the source's dtype when length is 0
        end = start + length
        d = int(np.searchsorted(self._offsets, start, side="right")) - 1
        while start < end:  # one piece per document the window touches
            take = min(end, int(self._offsets[d + 1])) - start
            if take > 0:
                first = int(self._source_starts[d]) + start - int(self._offsets[d])
                pieces.append(self.source.tokens(first, take))
                start += take
            d += 1
        return np.concatenate(pieces)

    def __repr__(self) -> str:
        return (
            f"DocumentSubset({len(self)} of {len(self.source)} documents, {self.num_tokens} tokens)"
        )
