"""A linear layer whose weight every tp rank holds whole (MLA's down-projections)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from mega_parallel_grid import group_rank, group_size
from mega_tp_layers import (
    Fp8Recipe,
    Fp8Shard,
    InitMethod,
    ShardedModule,
    ShardSpec,
    amax_history_for,
    cached_fp8_weight,
    creation_generator,
    delayed_for,
    fp8_linear,
    weight_cache_for,
)

__all__ = ["ReplicatedLinear"]


class ReplicatedLinear(ShardedModule):
    """``y = x W^T`` with ``W [out, in]`` replicated over ``tp_group`` (no bias).

    Each rank applies it to its own activations: the whole sequence, or under
    ``sequence_parallel`` its sequence shard ``[s/tp, b, in] -> [s/tp, b, out]``; then the
    weight's gradient is partial per rank, so the weight is marked for
    :func:`mega_tp_layers.sync_sequence_parallel_grads` (``finalize_model_grads`` sums it
    over tp, as it does the norms'). Rank 0 of the group counts it in norms and checkpoints.
    With ``fp8`` its GEMMs run in FP8, scaled as the whole sequence under SP.
    """

    weight: torch.nn.Parameter

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group: ProcessGroup,
        sequence_parallel: bool,
        init_method: InitMethod,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        fp8: Fp8Recipe | None = None,
    ) -> None:
        super().__init__()
        tp, rank = group_size(tp_group), group_rank(tp_group)
        spec = ShardSpec(None, tp, rank, "tp", (out_features, in_features), rank != 0)
        self._make_param(
            "weight", spec, init_method, generator=creation_generator(None, "", "weight"),
            dtype=dtype, device=device, sequence_parallel=sequence_parallel and tp > 1,
        )  # fmt: skip
        self.tp_group, self.sequence_parallel, self.fp8 = tp_group, sequence_parallel, fp8
        self.in_features, self.out_features = in_features, out_features
        self.fp8_amax = amax_history_for(fp8, device)
        self.fp8_weight = weight_cache_for(fp8, (out_features, in_features), device)

    def forward(self, x: Tensor) -> Tensor:
        if self.fp8 is None:
            return F.linear(x, self.weight)
        # x and dy: sequence shards (split along the tokens)
        shard = Fp8Shard(self.tp_group, 0) if self.sequence_parallel else None
        return fp8_linear(
            x, self.weight, recipe=self.fp8, x_group=shard, g_group=shard,
            delayed=delayed_for(self.fp8_amax, x),
            weight_q=cached_fp8_weight(self.fp8_weight, self.weight, self.fp8),
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, replicated, "
            f"sequence_parallel={self.sequence_parallel}{', fp8=True' if self.fp8 else ''}"
        )
