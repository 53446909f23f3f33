"""GPT samples: windows of seq_len+1 tokens over the concatenated documents, in a seeded order.

Sample ``j`` of an epoch is the window ``[j*seq_len, j*seq_len + seq_len + 1)`` of the
concatenation (consecutive windows share one token, so every token but the first is a label
once per epoch); documents are separated by the end-of-document token that preprocessing
appended. Global sample ``i`` is window ``perm_e[i mod E]`` with ``e = i // E``, ``E`` the
windows per epoch and ``perm_e`` a permutation drawn from ``(seed, e)``: any sample is found
by arithmetic, without building the corpus, so the trainer's "consumed samples" count is the
whole data position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch

from mega_pretrain.data.documents import TokenSource
from mega_pretrain.data.errors import DataError

__all__ = ["GPTDataset", "SampleDataset", "seeded_permutation", "to_sample"]


@runtime_checkable
class SampleDataset(Protocol):
    """A map-style dataset of training samples: ``ds[i] = {"tokens": [s], "labels": [s]}``."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]: ...


def to_sample(window: npt.NDArray[Any]) -> dict[str, torch.Tensor]:
    """``{"tokens": window[:-1], "labels": window[1:]}`` as ``int64`` tensors."""
    ids = torch.from_numpy(window.astype(np.int64))  # [s + 1]
    return {"tokens": ids[:-1], "labels": ids[1:]}  # [s], [s]


def seeded_permutation(size: int, key: Sequence[int]) -> npt.NDArray[Any]:
    """A permutation of ``range(size)`` fixed by the integers ``key`` (uint32 when it fits)."""
    rng = np.random.default_rng(list(key))
    dtype = np.uint32 if size < 2**32 else np.int64
    return rng.permutation(np.arange(size, dtype=dtype))


def check_index(index: int, length: int) -> int:
    """``index`` as an ``int`` in ``range(length)``, or ``IndexError``."""
    index = int(index)
    if not 0 <= index < length:
        raise IndexError(f"sample {index} is out of range for a dataset of {length} samples")
    return index


class GPTDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Samples of ``seq_len`` inputs and ``seq_len`` labels from a token source.

    ``len(ds)`` is ``num_samples`` when given (later epochs reuse the windows in a new order),
    else one epoch (``samples_per_epoch``). ``ds[i]`` returns ``{"tokens", "labels"}`` as
    ``int64`` tensors of shape ``[seq_len]``; ``ds.window(i)`` the raw ``seq_len + 1`` ids.
    With ``shuffle=False`` the windows come in corpus order (useful for evaluation).
    """

    def __init__(
        self,
        source: TokenSource,
        seq_len: int,
        *,
        seed: int,
        num_samples: int | None = None,
        shuffle: bool = True,
    ) -> None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len ({seq_len!r}) must be a positive integer")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed ({seed!r}) must be a non-negative integer")
        if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 0):
            raise ValueError(
                f"num_samples ({num_samples!r}) must be a non-negative integer, or None for one epoch"
            )
        if source.num_tokens < seq_len + 1:
            raise DataError(
                f"the data has {source.num_tokens} tokens, fewer than seq_len + 1 "
                f"({seq_len + 1}) that one sample needs; use a shorter seq_len or more data"
            )
        self.source = source
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.samples_per_epoch = (source.num_tokens - 1) // seq_len
        self.num_samples = self.samples_per_epoch if num_samples is None else num_samples
        self._perms: dict[int, npt.NDArray[Any]] = {}

    def __len__(self) -> int:
        return self.num_samples

    def window_index(self, index: int) -> int:
        """Which window of the corpus global sample ``index`` is."""
        index = check_index(index, self.num_samples)
        epoch, j = divmod(index, self.samples_per_epoch)
        if not self.shuffle:
            return j
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) >= 2:  # keep the current and the next epoch only
                self._perms.pop(min(self._perms))
            perm = self._perms[epoch] = seeded_permutation(
                self.samples_per_epoch, (self.seed, epoch)
            )
        return int(perm[j])

    def window(self, index: int) -> npt.NDArray[Any]:
        """The ``seq_len + 1`` token ids of global sample ``index``."""
        return self.source.tokens(self.window_index(index) * self.seq_len, self.seq_len + 1)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return to_sample(self.window(index))

    def __repr__(self) -> str:
        return (
            f"GPTDataset({self.num_samples} samples of seq_len {self.seq_len}, "
            f"{self.samples_per_epoch} per epoch, seed {self.seed})"
        )
