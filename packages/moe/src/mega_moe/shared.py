"""Shared experts: a dense MLP every token goes through, tensor parallel like the dense MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mega_moe._comm import Group, check_group, group_rank, group_size
from mega_moe._gemm import expert_activation
from mega_moe.config import ACTIVATIONS, Activation
from mega_tp_layers import (
    InitMethod,
    Normal,
    ShardedModule,
    ShardSpec,
    copy_to_tp_region,
    creation_generator,
    gather_from_sequence_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
)

__all__ = ["SharedExpertMLP"]


class SharedExpertMLP(ShardedModule):
    """``[s(/tp), b, h] -> [s(/tp), b, h]``: Column -> act -> Row over ``tp_group``.

    ``weight1 [G, ffn/tp, h]`` (G = 2 for SwiGLU: gate, then up; 1 for GeLU) and
    ``weight2 [h, ffn/tp]``, split over tp on the ffn dimension. Without sequence parallel
    the input is the same on every tp rank and the output is all-reduced; with it, the
    input is this rank's sequence slice, all-gathered before and reduce-scattered after.
    ``gate=True`` scales the output by ``sigmoid(x . gate_weight)`` per token (Qwen2-MoE).
    """

    weight1: nn.Parameter
    weight2: nn.Parameter
    gate_weight: nn.Parameter | None

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        tp_group: Group = None,
        sequence_parallel: bool = False,
        activation: Activation = "swiglu",
        gate: bool = False,
        init_method: InitMethod | None = None,
        output_init_method: InitMethod | None = None,
        seed: int | None = None,
        name: str = "",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        owner = "SharedExpertMLP"
        for label, value in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{owner} {label} ({value!r}) must be a positive integer")
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"{owner} activation ({activation!r}) must be one of "
                f"{', '.join(map(repr, ACTIVATIONS))}"
            )
        self.tp_group = check_group(tp_group, "tp_group", owner)
        tp, rank = group_size(tp_group), group_rank(tp_group)
        if ffn_hidden_size % tp:
            raise ValueError(
                f"shared_ffn_size ({ffn_hidden_size}) is not divisible by tp ({tp}); "
                f"choose a multiple of {tp}"
            )
        self.gated, self.sequence_parallel = activation == "swiglu", sequence_parallel
        g, h, f = (2 if self.gated else 1), hidden_size, ffn_hidden_size
        init1: InitMethod = init_method if init_method is not None else Normal(0.02)
        init2: InitMethod = output_init_method if output_init_method is not None else init1
        for pname, shape, init in (("weight1", (g, f, h), init1), ("weight2", (h, f), init2)):
            self._make_param(
                pname,
                ShardSpec(1, tp, rank, "tp", shape, False),
                init,
                generator=creation_generator(seed, name, pname),
                dtype=dtype,
                device=device,
            )
        if gate:
            self._make_param(
                "gate_weight",
                ShardSpec(None, tp, rank, "tp", (1, h), rank != 0),
                init1,
                generator=creation_generator(seed, name, "gate_weight"),
                dtype=dtype,
                device=device,
            )
        else:
            self.register_parameter("gate_weight", None)

    def forward(self, x: Tensor) -> Tensor:
        """``[s, b, h]`` (``[s/tp, b, h]`` under SP) -> the same shape."""
        group, sp = self.tp_group, self.sequence_parallel
        xin = x
        if group is not None and group_size(group) > 1:
            # [s/tp, b, h] -> [s, b, h] under SP; else identity (bwd: all-reduce)
            xin = gather_from_sequence_region(x, group) if sp else copy_to_tp_region(x, group)
        hidden = F.linear(xin, self.weight1.flatten(0, 1))  # -> [s, b, G*ffn/tp]
        out = F.linear(expert_activation(hidden, self.gated), self.weight2)  # partial over tp
        if group is not None and group_size(group) > 1:
            # -> [s/tp, b, h] under SP, else [s, b, h]
            if sp:
                out = reduce_scatter_to_sequence_region(out, group)
            else:
                out = reduce_from_tp_region(out, group)
        if self.gate_weight is not None:
            gate_weight: Tensor = self.gate_weight
            if sp and group is not None and group_size(group) > 1:
                gate_weight = copy_to_tp_region(gate_weight, group)  # slices: sum grads over tp
            out = out * torch.sigmoid(F.linear(x, gate_weight))  # [s(/tp), b, 1]
        return out
