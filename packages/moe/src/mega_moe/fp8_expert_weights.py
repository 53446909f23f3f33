"""One stacked expert weight in row-wise FP8, quantised once a step.

An FP8 expert FFN multiplies each expert weight ``[L, N, K]`` twice a micro-batch: in the
forward with one scale per output row (over K) and in the input gradient as its transpose
``[L, K, N]`` with one scale per input column (over N). Both copies are made the first
time a forward runs after an invalidation and read by every later forward of the step (its
other micro-batches, an activation recomputation), as mega-tp-layers' dense weight cache
does; the trainer invalidates every :class:`~mega_tp_layers.WeightCache` at the start of each
step. A fresh quantisation gives the same values bit for bit. The copies cost 2 bytes a
parameter, held for the run.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mega_moe._comm import Group
from mega_moe.fp8_rows import E4M3, Fp8Rows, quantize_columns_transposed, quantize_rows
from mega_tp_layers import WeightCache

__all__ = ["Fp8ExpertWeights"]


class Fp8ExpertWeights(WeightCache):
    """``weight [L, N, K]`` by output row (``data``) and transposed by input column (``data_t``).

    ``row_group`` / ``col_group``: the group over which K (for the rows) or N (for the
    columns) is sharded (expert tensor parallelism), so each scale spans the whole row.
    """

    data: Tensor
    inv_scale: Tensor
    data_t: Tensor
    inv_scale_t: Tensor

    def __init__(
        self,
        shape: tuple[int, int, int],
        device: torch.device | str | None = None,
        row_group: Group = None,
        col_group: Group = None,
    ) -> None:
        super().__init__()
        experts, n, k = shape
        self._register_kept("data", torch.zeros(shape, dtype=E4M3, device=device))
        self._register_kept("inv_scale", torch.ones(experts, n, device=device))
        self._register_kept("data_t", torch.zeros(experts, k, n, dtype=E4M3, device=device))
        self._register_kept("inv_scale_t", torch.ones(experts, k, device=device))
        self.row_group, self.col_group = row_group, col_group

    def quantized(self, weight: Tensor) -> tuple[Fp8Rows, Fp8Rows]:
        """(the forward's operand, the input gradient's), from the cache when it is valid."""
        if tuple(weight.shape) != tuple(self.data.shape):
            raise ValueError(
                f"Fp8ExpertWeights holds a weight of shape {tuple(self.data.shape)}, got "
                f"{tuple(weight.shape)}; build it for the layer's own stacked weight"
            )
        if not self.valid:
            with torch.no_grad():
                rows = quantize_rows(weight, self.row_group)
                cols = quantize_columns_transposed(weight, self.col_group)
                self.data.copy_(rows.data)
                self.inv_scale.copy_(rows.inv_scale)
                self.data_t.copy_(cols.data)
                self.inv_scale_t.copy_(cols.inv_scale)
            self.valid = True
        return Fp8Rows(self.data, self.inv_scale), Fp8Rows(self.data_t, self.inv_scale_t)

    def extra_repr(self) -> str:
        shape = "x".join(str(d) for d in self.data.shape)
        return f"shape={shape}, valid={self.valid}"
