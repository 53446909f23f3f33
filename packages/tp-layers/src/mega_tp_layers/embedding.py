"""Vocabulary-parallel embedding: each tp rank holds a contiguous slice of the vocabulary.

Under :func:`~mega_tp_layers.defer_weight_grads` the lookup has no B work (token ids take
no gradient): its whole backward is the W pass, the scatter-add of the output gradients
into the rows of the table the ids selected, run from the store.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function
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
from mega_tp_layers.wgrad import WeightGradStore, current_weight_grad_store

__all__ = ["VocabParallelEmbedding"]


class _SplitLookup(Function):
    """fwd: ``weight[ids]`` (rows ``outside`` zeroed) · bwd: the table's gradient queued

    ``anchor`` is an empty leaf that requires grad: nothing else does (the ids are integers,
    the table is detached so that its accumulator waits for W), and without it autograd
    would not call this backward at all.
    """

    @staticmethod
    def forward(
        ctx: Any,
        anchor: Tensor,
        weight: Tensor,
        ids: Tensor,
        outside: Tensor | None,
        params: tuple[Tensor],
        store: WeightGradStore,
    ) -> Tensor:
        ctx.save_for_backward(ids, outside)  # the parameter in a tuple: no edge to it
        ctx.params, ctx.store, ctx.rows = params, store, weight.shape[0]
        out = F.embedding(ids, weight)  # [s, b] -> [s, b, h]
        return out if outside is None else out.masked_fill(outside.unsqueeze(-1), 0.0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        ids, outside = ctx.saved_tensors
        (param,), rows = ctx.params, ctx.rows

        def wgrad() -> tuple[Tensor | None, ...]:
            g = grad if outside is None else grad.masked_fill(outside.unsqueeze(-1), 0.0)
            # the fused backward's own kernel: no padding row, no frequency scaling
            table = torch.ops.aten.embedding_dense_backward(g, ids, rows, -1, False)
            return (table.to(param.dtype),)

        ctx.store.defer(wgrad, ctx.params)
        return None, None, None, None, None, None


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
        store = current_weight_grad_store() if self.weight.requires_grad else None
        if self.tp == 1:
            if store is not None:
                return self._lookup(ids, None, store)
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        if store is not None:
            out = self._lookup(local_ids, outside, store)
        else:
            out = F.embedding(local_ids, self.weight)  # [s, b] -> [s, b, h], this slice only
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(out, self.tp_group)  # -> [s/tp, b, h]
        return reduce_from_tp_region_inplace(out, self.tp_group)  # -> [s, b, h]

    def _lookup(self, ids: Tensor, outside: Tensor | None, store: WeightGradStore) -> Tensor:
        """The lookup whose table gradient ``store`` computes in the W pass."""
        anchor = torch.empty(0, device=ids.device, requires_grad=True)
        w = self.weight.detach()
        out: Tensor = _SplitLookup.apply(anchor, w, ids, outside, (self.weight,), store)
        return out

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp}, "
            f"rows=[{self.vocab_start}, {self.vocab_end}) of {self.padded_num_embeddings}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
