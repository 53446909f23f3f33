"""``MoELayer``: router -> dispatch -> experts -> combine (+ shared experts), in place of an MLP."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Function

from mega_moe._comm import Group, check_group, group_size
from mega_moe.config import MoEConfig
from mega_moe.dispatcher import AllGatherDispatcher, AllToAllDispatcher
from mega_moe.experts import GroupedMLP, SequentialMLP
from mega_moe.fp8_rows import FP8_ROW_ALIGN
from mega_moe.router import RoutingStats, TopKRouter
from mega_moe.shared import SharedExpertMLP
from mega_tp_layers import InitMethod, gather_from_sequence_region, scatter_to_sequence_region

__all__ = ["MoELayer"]


class _AttachLoss(Function):
    """fwd: identity on the output · bwd: the output's gradient, and ``scale`` for the loss"""

    @staticmethod
    def forward(ctx: Any, out: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def _child(name: str, child: str) -> str:
    return f"{name}.{child}" if name else child


class MoELayer(nn.Module):
    """A mixture-of-experts block with the interface of a transformer MLP.

    ``forward(x)``: ``[s, b, h] -> [s, b, h]``, or ``[s/tp, b, h] -> [s/tp, b, h]`` with
    ``sequence_parallel``, exactly like the dense MLP it replaces. After each forward,
    ``layer.last_stats`` (a :class:`RoutingStats`) holds this rank's router losses (with
    gradient: add ``last_stats.loss`` to the training loss, or set
    ``MoEConfig.aux_loss_in_backward``) and its per-expert token counts.

    Groups (each None for one rank; nothing is read from globals):

    - ``ep_group`` / ``etp_group``: expert parallel and expert tensor parallel, from the
      expert layout of mega_parallel_grid (``groups.ep``, ``groups.etp``).
    - ``tp_group``: the surrounding layer's tensor-parallel group. The routed part works
      on distinct tokens per rank: without sequence parallel the input (the same on every
      tp rank) is split over tp along the sequence and the output all-gathered back; with
      it the input already is this rank's slice. Shared experts are tensor parallel over
      it, like the dense MLP.
    - ``sequence_group`` / ``aux_loss_group``: see :class:`TopKRouter` (default: tp).
    """

    def __init__(
        self,
        hidden_size: int,
        config: MoEConfig,
        *,
        ep_group: Group = None,
        etp_group: Group = None,
        tp_group: Group = None,
        sequence_parallel: bool = False,
        sequence_group: Group = None,
        aux_loss_group: Group = None,
        init_method: InitMethod | None = None,
        output_init_method: InitMethod | None = None,
        seed: int | None = None,
        name: str = "",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        owner = "MoELayer"
        if not isinstance(config, MoEConfig):
            raise TypeError(f"{owner} needs a MoEConfig, got {type(config).__name__}")
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"{owner} hidden_size ({hidden_size!r}) must be a positive integer")
        self.tp_group = check_group(tp_group, "tp_group", owner)
        self.config, self.hidden_size = config, hidden_size
        self.sequence_parallel = sequence_parallel
        common: dict[str, Any] = {"seed": seed, "dtype": dtype, "device": device}
        inits: dict[str, Any] = {
            "init_method": init_method,
            "output_init_method": output_init_method,
        }
        self.router = TopKRouter(
            hidden_size,
            config.router,
            tp_group=tp_group,
            sequence_group=sequence_group,
            aux_loss_group=aux_loss_group,
            init_method=init_method,
            name=_child(name, "router"),
            **common,
        )
        experts_args: dict[str, Any] = {
            "ep_group": ep_group,
            "etp_group": etp_group,
            "activation": config.activation,
            "name": _child(name, "experts"),
            **inits,
            **common,
        }
        self.experts: GroupedMLP | SequentialMLP
        if config.experts == "grouped":
            self.experts = GroupedMLP(
                hidden_size,
                config.ffn_hidden_size,
                config.num_experts,
                gemm=config.grouped_gemm,
                fp8=config.expert_fp8,
                **experts_args,
            )
        else:
            self.experts = SequentialMLP(
                hidden_size, config.ffn_hidden_size, config.num_experts, **experts_args
            )
        self.shared_experts: SharedExpertMLP | None = None
        if config.shared_ffn_size > 0:
            self.shared_experts = SharedExpertMLP(
                hidden_size,
                config.shared_ffn_size,
                tp_group=tp_group,
                sequence_parallel=sequence_parallel,
                activation=config.activation,
                gate=config.shared_expert_gate,
                name=_child(name, "shared_experts"),
                **inits,
                **common,
            )
        kind = AllToAllDispatcher if config.dispatcher == "alltoall" else AllGatherDispatcher
        self.dispatcher = kind(config.num_experts, ep_group=ep_group, etp_group=etp_group,
                               row_align=FP8_ROW_ALIGN if config.expert_fp8 else 1)  # fmt: skip
        self.last_stats: RoutingStats | None = None
        self.aux_loss_scale = 1.0
        """Gradient of the router losses when ``aux_loss_in_backward`` (e.g. 1/microbatches)."""

    def forward(self, x: Tensor) -> Tensor:
        """``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallel) -> the same shape."""
        h, tp, group = self.hidden_size, group_size(self.tp_group), self.tp_group
        if x.dim() != 3 or x.shape[-1] != h:
            raise ValueError(
                f"MoELayer expects sequence-first input [s, b, {h}], got shape "
                f"{tuple(x.shape)}; pass the activation the MLP would get"
            )
        split = tp > 1 and not self.sequence_parallel
        if split and x.shape[0] % tp:
            raise ValueError(
                f"sequence length ({x.shape[0]}) is not divisible by tp ({tp}) in MoELayer; "
                f"pad the sequence to a multiple of {tp}"
            )
        local = x
        if split:
            assert group is not None
            local = scatter_to_sequence_region(x, group)  # [s, b, h] -> [s/tp, b, h]
        routing = self.router(local)
        shared = self.shared_experts
        during: Callable[[], Tensor] | None = None
        if shared is not None and self.config.overlap_shared_experts:
            during = partial(shared, x)
        dispatched = self.dispatcher.dispatch(local.reshape(-1, h), routing, during)
        if dispatched.aligned:
            assert isinstance(self.experts, GroupedMLP)
            y = self.experts(dispatched.tokens, dispatched.counts, aligned=True)  # [M, h]
        else:
            y = self.experts(dispatched.tokens, dispatched.counts)
        out = self.dispatcher.combine(y, dispatched).view_as(local)  # [N, h] -> [s/tp, b, h]
        if split:
            assert group is not None  # [s/tp, b, h] -> [s, b, h]; bwd: keep own slice
            out = gather_from_sequence_region(out, group, tensor_parallel_output_grad=False)
        if shared is not None:
            side = dispatched.side if dispatched.side is not None else shared(x)
            out = out + side
        stats = routing.stats
        self.last_stats = stats
        if self.config.aux_loss_in_backward and stats.loss.requires_grad:
            attached: Tensor = _AttachLoss.apply(out, stats.loss, self.aux_loss_scale)
            return attached
        return out

    @torch.no_grad()
    def update_expert_bias(self, group: Group = None) -> None:
        """See :meth:`TopKRouter.update_expert_bias`."""
        self.router.update_expert_bias(group)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"hidden_size={self.hidden_size}, experts={c.num_experts}, top_k={c.top_k}, "
            f"ffn={c.ffn_hidden_size}, dispatcher={c.dispatcher}, impl={c.experts}, "
            f"shared={c.shared_ffn_size}, sequence_parallel={self.sequence_parallel}"
        )
