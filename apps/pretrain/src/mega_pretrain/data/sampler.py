"""Which samples each data-parallel rank reads, resumable from a count of consumed samples.

The sample stream ``0, 1, 2, ...`` (of a dataset that is already shuffled) is cut into
batches of ``micro_batch_size * dp_size``; in each, dp rank ``r`` takes the ``r``-th slice of
``micro_batch_size``. Gradient accumulation just takes several of these in a row. A run
resumed at ``consumed_samples = N`` therefore sees exactly what an uninterrupted run saw after
its first ``N`` samples, and the trainer's checkpoint needs only ``N``. Tensor-, context- and
pipeline-parallel ranks of one replica share a dp rank, so they get the same indices.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["DistributedBatchSampler"]


def _check_int(name: str, value: object, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} ({value!r}) must be an integer >= {low}")
    return value


class DistributedBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields this dp rank's micro-batches (lists of sample indices), from ``consumed_samples``.

    >>> list(DistributedBatchSampler(8, 0, micro_batch_size=2, dp_rank=1, dp_size=2))
    [[2, 3], [6, 7]]

    With ``drop_last`` a last batch smaller than ``micro_batch_size * dp_size`` is dropped;
    without it, each rank takes its slice of it and a rank whose slice is empty yields
    nothing more (use it for evaluation, not training). ``consumed_samples`` advances by
    one whole batch each time a micro-batch is handed out; a loader that reads ahead
    (``num_workers > 0``) hands out more than the trainer has used, so the trainer counts
    consumed samples itself and builds a new sampler from that count when it resumes.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        drop_last: bool = True,
    ) -> None:
        super().__init__()
        self.total_samples = _check_int("total_samples", total_samples, 0)
        self.micro_batch_size = _check_int("micro_batch_size", micro_batch_size, 1)
        self.dp_size = _check_int("dp_size", dp_size, 1)
        _check_int("dp_rank", dp_rank, 0)
        if dp_rank >= dp_size:
            raise ValueError(f"dp_rank ({dp_rank}) must be below dp_size ({dp_size})")
        self.dp_rank = dp_rank
        self.drop_last = drop_last
        self.consumed_samples = self._check_consumed(consumed_samples)

    def _check_consumed(self, consumed: object) -> int:
        consumed = _check_int("consumed_samples", consumed, 0)
        if consumed > self.total_samples:
            raise ValueError(
                f"consumed_samples ({consumed}) is past total_samples ({self.total_samples}); "
                "the run has already used every sample, raise the number of samples to go on"
            )
        return consumed

    @property
    def batch_size(self) -> int:
        """Samples taken by all dp ranks together per micro-batch: ``micro_batch_size * dp_size``."""
        return self.micro_batch_size * self.dp_size

    def _slice(self, start: int) -> range:
        end = min(start + self.batch_size, self.total_samples)
        first = start + self.dp_rank * self.micro_batch_size
        return range(first, min(first + self.micro_batch_size, end))

    def __len__(self) -> int:
        """Micro-batches this rank will yield from the current ``consumed_samples``."""
        left = self.total_samples - self.consumed_samples
        full, rest = divmod(left, self.batch_size)
        if self.drop_last or rest == 0:
            return full
        return full + (1 if len(self._slice(self.consumed_samples + full * self.batch_size)) else 0)

    def __iter__(self) -> Iterator[list[int]]:
        while self.consumed_samples < self.total_samples:
            start = self.consumed_samples
            if self.drop_last and start + self.batch_size > self.total_samples:
                return
            mine = self._slice(start)
            self.consumed_samples = min(start + self.batch_size, self.total_samples)
            if not mine:
                return
            yield list(mine)

    def state_dict(self) -> dict[str, int]:
        """``{"consumed_samples": n}``: the whole data position."""
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed_samples = self._check_consumed(state["consumed_samples"])
