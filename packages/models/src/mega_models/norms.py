"""RMSNorm and LayerNorm whose parameters are replicated over tp."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from mega_tp_layers import (
    INIT_ATTR,
    KeepsParamAttrs,
    Zeros,
    mark_replicated,
    mark_sequence_parallel,
)

__all__ = ["Norm", "Ones"]


@dataclass(frozen=True)
class Ones:
    """Fills with ones (norm scales)."""

    def __call__(self, full: Tensor, generator: torch.Generator) -> None:
        full.fill_(1.0)


class Norm(KeepsParamAttrs):
    """``rmsnorm`` or ``layernorm`` over the last dimension, parameters replicated over tp.

    ``partial_grads`` marks the parameters whose gradient is partial on each tp rank —
    under sequence parallelism (each rank normalises a slice of the sequence), or for a
    QK-norm shared by heads split over tp — so that
    :func:`mega_tp_layers.sync_sequence_parallel_grads` sums them over tp.
    """

    def __init__(
        self,
        size: int,
        kind: str,
        eps: float,
        *,
        tp_group: ProcessGroup,
        partial_grads: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.kind, self.eps, self.size = kind, eps, size
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        setattr(self.weight, INIT_ATTR, Ones())
        self.bias: nn.Parameter | None = None
        if kind == "layernorm":
            self.bias = nn.Parameter(torch.zeros(size, device=device, dtype=dtype))
            setattr(self.bias, INIT_ATTR, Zeros())
        for p in self.parameters():
            mark_replicated(p, tp_group)
            if partial_grads:
                mark_sequence_parallel(p)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "rmsnorm":
            return F.rms_norm(x, (self.size,), self.weight, self.eps)
        return F.layer_norm(x, (self.size,), self.weight, self.bias, self.eps)
