"""Vocabulary checks of a token file: a bounded sample of its ids, and whether a model's
vocabulary covers them (re-exported by :mod:`mega_pretrain.data.indexed`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from mega_pretrain.data.errors import DataError
from mega_pretrain.data.indexed import IndexedTokenDataset

__all__ = ["check_vocab", "sampled_id_range", "sampled_max_id"]


def _sampled_windows(ds: IndexedTokenDataset, blocks: int, block: int) -> list[npt.NDArray[Any]]:
    """``blocks`` evenly spaced windows of ``block`` tokens (first and last included), or the
    whole file when it is no larger: a bounded read, whatever the file's size."""
    n = ds.num_tokens
    if n == 0:
        return []
    if n <= blocks * block:
        return [ds.tokens(0, n)]
    starts = np.linspace(0, n - block, blocks).astype(np.int64)
    return [ds.tokens(int(start), block) for start in starts]


def sampled_id_range(
    ds: IndexedTokenDataset, blocks: int = 256, block: int = 1024
) -> tuple[int, int] | None:
    """(smallest, largest) id in the windows :func:`sampled_max_id` reads; None when the file
    holds no token. Raises DataError when a float file's sample holds an id that is not a
    whole number (Megatron's format allows float dtypes)."""
    windows = _sampled_windows(ds, blocks, block)
    if not windows:
        return None
    if np.issubdtype(ds.header.dtype, np.floating):
        for window in windows:
            bad = window[~np.isfinite(window) | (window != np.round(window))]
            if bad.size:
                raise DataError(
                    f"the token file {ds.bin_path} ({ds.header.dtype.name}) holds {float(bad[0])}, "
                    "which is not a token id (ids are whole numbers); tokenize the data again"
                )
    low = min(int(w.min()) for w in windows)
    high = max(int(w.max()) for w in windows)
    return low, high


def sampled_max_id(ds: IndexedTokenDataset, blocks: int = 256, block: int = 1024) -> int:
    """The largest id in ``blocks`` evenly spaced windows of ``block`` tokens (all of a small
    file): a bounded read, ``blocks * block`` tokens at most, whatever the file's size; -1 when
    the file holds no token."""
    found = sampled_id_range(ds, blocks, block)
    return -1 if found is None else found[1]


def check_vocab(prefix: str | Path, vocab_size: int) -> None:
    """Raise DataError (one sentence) when the token file at ``prefix`` holds ids the model's
    vocabulary (``vocab_size``) has no embedding for: by its header's vocabulary (a mega
    file's; Megatron's index records none), and, since a header written by another tool may
    understate it, by the ids of a bounded sample (negative ids of a signed dtype included)."""
    ds = IndexedTokenDataset(prefix)
    way_out = (
        "set --model.vocab_size to at least {need}, or preprocess the data with the "
        "model's tokenizer"
    )
    if ds.vocab_size is not None and ds.vocab_size > vocab_size:
        raise DataError(
            f"the token file {ds.bin_path} was written for a vocabulary of {ds.vocab_size} "
            f"tokens but the model has vocab_size {vocab_size}; "
            + way_out.format(need=ds.vocab_size)
        )
    found = sampled_id_range(ds)
    if found is None:
        return
    low, high = found
    if low < 0:
        raise DataError(
            f"the token file {ds.bin_path} ({ds.header.dtype.name}) holds token id {low}; "
            "ids are 0 or more, so it was not written by a tokenizer: preprocess the data again"
        )
    if high >= vocab_size:
        raise DataError(
            f"the token file {ds.bin_path} holds token id {high}, outside the model's "
            f"vocab_size {vocab_size} (ids 0..{vocab_size - 1}); " + way_out.format(need=high + 1)
        )
