"""The feed-forward block: column GEMM, SwiGLU, GeLU or squared ReLU, row GEMM."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from mega_models.config import GPTConfig
from mega_models.fused_ops import activation, run_fused
from mega_tp_layers import ColumnParallelLinear, Fp8Recipe, Normal, RowParallelLinear, ScaledNormal

__all__ = ["MLP"]


class MLP(nn.Module):
    """``[s(/tp), b, h] -> [s(/tp), b, h]``.

    For SwiGLU the first GEMM is fused (gate and up); its full rows interleave them one by
    one (gate_0, up_0, gate_1, up_1, ...), so an even split over tp gives each rank
    matching gate/up pairs and the full weight is the same at any tp.
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        tp_group: ProcessGroup,
        sequence_parallel: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        fp8: Fp8Recipe | None = None,
        tp_comm_overlap: bool = False,
    ) -> None:
        super().__init__()
        c = config
        self.swiglu = c.activation == "swiglu"
        self.activation = c.activation
        self.fused = c.fused_elementwise
        common: dict[str, Any] = {"tp_group": tp_group, "sequence_parallel": sequence_parallel,
                  "device": device, "dtype": dtype, "bias": c.add_bias, "fp8": fp8,
                  "tp_comm_overlap": tp_comm_overlap, "wgrad_fusion": True}  # fmt: skip
        width = 2 * c.ffn_size if self.swiglu else c.ffn_size
        self.fc1 = ColumnParallelLinear(
            c.hidden_size, width, init_method=Normal(c.init_std), **common
        )
        self.fc2 = RowParallelLinear(
            c.ffn_size, c.hidden_size, init_method=ScaledNormal(c.init_std, c.num_layers),
            **common,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)  # [s(/tp), b, h] -> [s, b, (2) ffn / tp]
        y = run_fused(self.fused, activation, y, self.activation)
        out: torch.Tensor = self.fc2(y)  # -> [s(/tp), b, h]
        return out
