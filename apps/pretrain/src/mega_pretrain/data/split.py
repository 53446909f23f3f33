"""Train/validation split: by documents (a token source) or by samples (a sample dataset)."""

from __future__ import annotations

from typing import Any, overload

import numpy as np
import numpy.typing as npt
import torch

from mega_pretrain.data.dataset import SampleDataset, check_index
from mega_pretrain.data.documents import DocumentSubset, TokenSource

__all__ = ["SampleSubset", "split_train_valid"]


class SampleSubset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """The samples ``indices`` of ``dataset``, renumbered ``0..len-1``."""

    def __init__(self, dataset: SampleDataset, indices: npt.ArrayLike) -> None:
        self.dataset = dataset
        self.indices = np.asarray(indices, dtype=np.int64).reshape(-1)

    def __len__(self) -> int:
        return int(self.indices.size)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.dataset[int(self.indices[check_index(index, len(self))])]

    def __repr__(self) -> str:
        return f"SampleSubset({len(self)} of {len(self.dataset)} samples)"


def _valid_ids(total: int, valid_fraction: float, seed: int, what: str) -> npt.NDArray[Any]:
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed ({seed!r}) must be a non-negative integer")
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(
            f"valid_fraction ({valid_fraction!r}) must be in [0, 1); e.g. 0.01 keeps 1% apart"
        )
    count = max(1, round(valid_fraction * total)) if valid_fraction > 0 else 0
    if count >= total:
        raise ValueError(
            f"valid_fraction {valid_fraction} of {total} {what} leaves none to train on; "
            f"give more {what} or a smaller valid_fraction"
        )
    # a seeded choice, in the original order so that reads stay mostly sequential
    return np.sort(np.random.default_rng([seed, 0x5911]).permutation(total)[:count])


@overload
def split_train_valid(
    data: TokenSource, valid_fraction: float, seed: int
) -> tuple[DocumentSubset, DocumentSubset]: ...


@overload
def split_train_valid(
    data: SampleDataset, valid_fraction: float, seed: int
) -> tuple[SampleSubset, SampleSubset]: ...


def split_train_valid(
    data: TokenSource | SampleDataset, valid_fraction: float, seed: int
) -> tuple[DocumentSubset, DocumentSubset] | tuple[SampleSubset, SampleSubset]:
    """Split into (train, valid), deterministic in ``seed``.

    A token source (e.g. an ``IndexedTokenDataset``) is split by documents: a seeded choice
    of ``round(valid_fraction * documents)`` documents (at least one when the fraction is not
    0) becomes the validation source, the rest the training source; build a ``GPTDataset``
    on each, so no token is in both. A sample dataset is split the same way by samples.
    """
    if isinstance(data, TokenSource):
        n = len(data)
        valid = _valid_ids(n, valid_fraction, seed, "documents")
        train = np.setdiff1d(np.arange(n, dtype=np.int64), valid, assume_unique=True)
        return DocumentSubset(data, train), DocumentSubset(data, valid)
    n = len(data)
    valid = _valid_ids(n, valid_fraction, seed, "samples")
    train = np.setdiff1d(np.arange(n, dtype=np.int64), valid, assume_unique=True)
    return SampleSubset(data, train), SampleSubset(data, valid)
