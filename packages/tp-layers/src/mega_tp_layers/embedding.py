"""Vocabulary-parallel embedding: each tp rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from mega_tp_layers._comm import check_divisible_dim0, check_group, group_rank, group_size
from mega_tp_layers.init import InitMethod, Normal, PaddedRows
from mega_tp_layers.mappings import (
    reduce_from_tp_region_inplace,
    reduce_scatter_to_sequence_region,
)
from mega_tp_layers.params import ShardedModule, creation_generator
from mega_tp_layers.shard import ShardSpec
from mega_tp_layers.vocab import padded_vocab_size, vocab_range

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(ShardedModule):
    """``nn.Embedding`` with its rows split over ``tp_group``.

    The vocabulary is padded to ``padded_vocab_size(num_embeddings, tp)`` rows (zero rows
    that no valid id selects); rank ``r`` holds rows ``[vocab_start, vocab_end)``. Each
    rank looks up the ids in its range, zeroes the others, and one all-reduce sums the
    ranks' results into ``[s, b, h]`` — or, with ``sequence_parallel``, one
    reduce-scatter gives ``[s/tp, b, h]`` (ids must then be sequence-first ``[s, b]``).
    Ids are not range-checked (that would cost a device sync): an id in
    ``[num_embeddings, padded size)`` gives a zero vector instead of an error.
    """

    weight: nn.Parameter

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: ProcessGroup,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        seed: int | None = None,
        name: str = "",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        group_name: str = "tp",
    ) -> None:
        super().__init__()
        self.tp_group = check_group(tp_group, "VocabParallelEmbedding")
        for label, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"VocabParallelEmbedding {label} ({value!r}) must be positive")
        tp, rank = group_size(tp_group), group_rank(tp_group)
        padded = padded_vocab_size(num_embeddings, tp)
        self.num_embeddings, self.embedding_dim, self.tp = num_embeddings, embedding_dim, tp
        self.padded_num_embeddings = padded
        self.vocab_start, self.vocab_end = vocab_range(padded, tp, rank)
        self.sequence_parallel = sequence_parallel
        w_init: InitMethod = init_method if init_method is not None else Normal(0.02)
        if padded != num_embeddings:
            w_init = PaddedRows(w_init, num_embeddings)
        spec = ShardSpec(0, tp, rank, group_name, (padded, embedding_dim), False)
        self._make_param(
            "weight", spec, w_init, generator=creation_generator(seed, name, "weight"),
            dtype=dtype, device=device,
        )  # fmt: skip

    def forward(self, ids: Tensor) -> Tensor:
        """``[s, b]`` token ids -> ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallel)."""
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(
                f"VocabParallelEmbedding expects integer token ids, got dtype {ids.dtype}; "
                "pass a torch.long tensor"
            )
        if self.sequence_parallel:
            check_divisible_dim0(ids, self.tp, "VocabParallelEmbedding")
        if self.tp == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight)  # [s, b] -> [s, b, h], this slice only
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(out, self.tp_group)  # -> [s/tp, b, h]
        return reduce_from_tp_region_inplace(out, self.tp_group)  # -> [s, b, h]

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp}, "
            f"rows=[{self.vocab_start}, {self.vocab_end}) of {self.padded_num_embeddings}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
