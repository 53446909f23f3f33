"""The top-k router: fp32 scores, expert choice, capacity, balancing losses, expert bias."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mega_moe._comm import Group, all_reduce, check_group, group_rank, group_size
from mega_moe.config import RouterConfig
from mega_moe.recompute import is_recomputing
from mega_moe.scores import (
    drop_over_capacity,
    select_experts,
    seq_aux_loss_share,
    switch_aux_loss_share,
    z_loss_share,
)
from mega_tp_layers import (
    InitMethod,
    Normal,
    ShardedModule,
    ShardSpec,
    copy_to_tp_region,
    creation_generator,
)

__all__ = ["Routing", "RoutingStats", "TopKRouter"]


@dataclass(frozen=True)
class RoutingStats:
    """What one forward of a router reports: its losses (this rank's shares) and its load."""

    aux_loss: Tensor
    """Switch-style balancing loss share (fp32 scalar with gradient; 0 when off)."""
    seq_aux_loss: Tensor
    """Sequence-level balancing loss share (0 when off)."""
    z_loss: Tensor
    """Router z-loss share (0 when off)."""
    tokens_per_expert: Tensor
    """``[E]`` int64: this rank's tokens each expert receives after dropping (no gradient)."""
    num_dropped: Tensor
    """int64 scalar: this rank's (token, expert) choices dropped for capacity."""

    @property
    def loss(self) -> Tensor:
        """The sum of the three losses: add it to this rank's training loss."""
        return self.aux_loss + self.seq_aux_loss + self.z_loss


@dataclass(frozen=True)
class Routing:
    """The router's decision for ``N`` local tokens (sequence-first order)."""

    probs: Tensor
    """``[N, E]`` fp32 combine weights, zero where a token does not go (with gradient)."""
    routing_map: Tensor
    """``[N, E]`` bool: token n goes to expert e (after dropping)."""
    capacity: int | None
    """Tokens an expert takes from this rank (None: no limit)."""
    pad_to_capacity: bool
    """Dispatch exactly ``capacity`` rows per expert."""
    top_k: int
    """Experts each token chose (each keeps exactly this many when ``capacity`` is None)."""
    stats: RoutingStats


class TopKRouter(ShardedModule):
    """Scores ``[s, b, h]`` (or ``[N, h]``) tokens against ``E`` experts and picks ``top_k``.

    The weight ``[E, h]`` is replicated; logits and everything after them are fp32.
    Groups (each may be None for one rank):

    - ``tp_group``: the ranks this layer's tokens are split over (the MoE layer splits
      them over tp). The weight's gradient is summed over it, so every rank holds the
      full gradient.
    - ``sequence_group`` (default ``tp_group``): ranks holding parts of the same sequences
      (tp, times cp under context parallelism). The z-loss and the sequence-level loss
      are over whole sequences; every rank must route the same number of tokens.
    - ``aux_loss_group`` (default ``sequence_group``): ranks whose tokens the switch-style
      loss balances together (e.g. ``tp_dp_cp`` for the global batch): the per-expert
      counts are all-reduced over it.

    Each loss is this rank's share: summed over the ranks of its group, the shares give
    the loss over all the group's tokens (see :mod:`mega_moe.scores`).
    """

    weight: nn.Parameter
    expert_bias: Tensor | None
    load: Tensor

    def __init__(
        self,
        hidden_size: int,
        config: RouterConfig,
        *,
        tp_group: Group = None,
        sequence_group: Group = None,
        aux_loss_group: Group = None,
        init_method: InitMethod | None = None,
        seed: int | None = None,
        name: str = "",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        owner = "TopKRouter"
        if not isinstance(config, RouterConfig):
            raise TypeError(f"{owner} needs a RouterConfig, got {type(config).__name__}")
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"{owner} hidden_size ({hidden_size!r}) must be a positive integer")
        self.tp_group = check_group(tp_group, "tp_group", owner)
        sequence_group = check_group(sequence_group, "sequence_group", owner)
        self.sequence_group = tp_group if sequence_group is None else sequence_group
        aux_loss_group = check_group(aux_loss_group, "aux_loss_group", owner)
        self.aux_loss_group = self.sequence_group if aux_loss_group is None else aux_loss_group
        self.config, self.hidden_size = config, hidden_size
        tp, rank, e = group_size(tp_group), group_rank(tp_group), config.num_experts
        spec = ShardSpec(None, tp, rank, "tp", (e, hidden_size), rank != 0)
        self._make_param(
            "weight",
            spec,
            init_method if init_method is not None else Normal(0.02),
            generator=creation_generator(seed, name, "weight"),
            dtype=dtype,
            device=device,
        )
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32, device=device))
            self.register_buffer(
                "load", torch.zeros(e, dtype=torch.int64, device=device), persistent=False
            )
        else:
            self.expert_bias = None

    def forward(self, x: Tensor) -> Routing:
        """``[s, b, h]`` or ``[N, h]`` -> the routing of its ``s*b`` tokens (s-major order)."""
        c, h = self.config, self.hidden_size
        if x.dim() not in (2, 3) or x.shape[-1] != h:
            raise ValueError(
                f"TopKRouter expects [s, b, {h}] or [tokens, {h}] input, got shape "
                f"{tuple(x.shape)}; pass sequence-first activations of hidden size {h}"
            )
        seqs = 1 if x.dim() == 2 else x.shape[1]
        tokens = x.reshape(-1, h)  # [s, b, h] -> [N, h]
        n = tokens.shape[0]
        weight: Tensor = self.weight
        if group_size(self.tp_group) > 1:
            assert self.tp_group is not None
            weight = copy_to_tp_region(weight, self.tp_group)  # bwd: sum over tp
        logits = F.linear(tokens.float(), weight.float())  # [N, E] fp32
        weights, index, balance = select_experts(logits, c, self.expert_bias)
        chosen = torch.zeros_like(logits, dtype=torch.bool).scatter(1, index, True)
        probs = torch.zeros_like(logits).scatter(1, index, weights)  # [N, E]
        if self.expert_bias is not None and self.training and not is_recomputing():
            with torch.no_grad():  # a recomputation in backward routed these tokens already
                self.load += chosen.sum(dim=0)
        capacity = c.capacity(n)
        kept = chosen
        if capacity is not None:
            kept = drop_over_capacity(chosen, probs, capacity, c.drop_policy)
            probs = probs * kept
        stats = RoutingStats(
            aux_loss=self._aux_loss(balance, chosen, n),
            seq_aux_loss=self._seq_aux_loss(balance, chosen, seqs),
            z_loss=self._z_loss(logits, n),
            tokens_per_expert=kept.sum(dim=0).detach(),
            num_dropped=(chosen.sum() - kept.sum()).detach(),
        )
        return Routing(probs, kept, capacity, c.pad_to_capacity, c.top_k, stats)

    def _aux_loss(self, balance: Tensor, chosen: Tensor, n: int) -> Tensor:
        coeff = self.config.aux_loss_coeff
        if coeff == 0.0:
            return balance.new_zeros(())
        stats = torch.cat([chosen.sum(dim=0).float(), balance.new_tensor([float(n)])])
        all_reduce(stats, self.aux_loss_group)  # [E + 1]: counts and tokens of the group
        return switch_aux_loss_share(balance, stats[:-1], stats[-1], self.config.top_k, coeff)

    def _seq_aux_loss(self, balance: Tensor, chosen: Tensor, seqs: int) -> Tensor:
        coeff = self.config.seq_aux_loss_coeff
        if coeff == 0.0:
            return balance.new_zeros(())
        per_seq = chosen.view(-1, seqs, chosen.shape[-1]).sum(dim=0).float()  # [b, E]
        all_reduce(per_seq, self.sequence_group)
        seq_len = (balance.shape[0] // seqs) * group_size(self.sequence_group)
        return seq_aux_loss_share(balance, per_seq, seq_len, self.config.top_k, coeff)

    def _z_loss(self, logits: Tensor, n: int) -> Tensor:
        coeff = self.config.z_loss_coeff
        if coeff == 0.0:
            return logits.new_zeros(())
        return z_loss_share(logits, n * group_size(self.sequence_group), coeff)

    @torch.no_grad()
    def update_expert_bias(self, group: Group = None) -> None:
        """Move the expert bias toward balance: ``bias += rate * sign(mean_load - load)``.

        ``load`` counts the choices of the training forwards since the last update, summed
        over ``group``: pass every rank that holds a replica of this router (e.g.
        ``tp_dp_cp``) so that all replicas keep the same bias. Collective over ``group``.
        """
        if self.expert_bias is None:
            raise ValueError(
                "update_expert_bias needs RouterConfig(expert_bias=True); "
                "turn on aux-loss-free balancing first"
            )
        self.apply_load(all_reduce(self.load.float(), group))

    @torch.no_grad()
    def apply_load(self, load: Tensor) -> None:
        """One bias step from a summed ``load [E]``; clears the local count."""
        assert self.expert_bias is not None
        self.expert_bias += self.config.bias_update_rate * torch.sign(load.mean() - load)
        self.load.zero_()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Any:
        before = self.expert_bias
        fresh = before is not None and before.device.type == "meta"
        result = super()._apply(fn, recurse)
        after = self.expert_bias
        if before is not None and after is not None and after.dtype != torch.float32:
            # `.to(torch.bfloat16)` casts every floating buffer; the bias stays fp32 (as
            # Megatron keeps it): in bf16 its steps of `bias_update_rate` round away
            fp32 = torch.float32
            kept = after.float() if fresh else before.to(device=after.device, dtype=fp32)
            self.expert_bias = kept
        if fresh and self.expert_bias is not None and self.expert_bias.device.type != "meta":
            with torch.no_grad():  # materialised from meta (to_empty): start from zero
                self.expert_bias.zero_()
                self.load.zero_()
        return result

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"hidden_size={self.hidden_size}, num_experts={c.num_experts}, top_k={c.top_k}, "
            f"score_function={c.score_function}, expert_bias={c.expert_bias}"
        )
