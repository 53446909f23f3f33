"""GPTModel: the whole decoder, or the chunk of it that one pipeline stage owns."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from mega_models.config import GPTConfig
from mega_models.context_parallel import zigzag_positions
from mega_models.head import lm_head
from mega_models.layer import TransformerLayer, rng_checkpoint_contexts
from mega_models.norms import Norm
from mega_models.replicated import KeepsParamAttrs
from mega_models.rope import rope_tables
from mega_models.stages import StageSpec, stage_spec
from mega_parallel_grid import ProcessGroups
from mega_tp_layers import (
    INIT_ATTR,
    ColumnParallelLinear,
    Normal,
    RNGStatesTracker,
    VocabParallelEmbedding,
    init_parameters,
    mark_replicated,
    scatter_to_sequence_region,
    set_shard_spec,
    shard_spec,
)

__all__ = ["GPTModel"]

Recompute = Literal["none", "selective", "full"]


class _Embedding(nn.Module):
    """Token embedding (vocab-parallel) plus an optional learned position table."""

    def __init__(
        self,
        config: GPTConfig,
        tp_group: ProcessGroup,
        sp: bool,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.word = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_group=tp_group, sequence_parallel=sp,
            init_method=Normal(config.init_std), device=device, dtype=dtype,
        )  # fmt: skip
        self.position: _Positions | None = None
        if config.position == "learned":
            self.position = _Positions(config, tp_group, device, dtype)


class _Positions(KeepsParamAttrs):
    def __init__(
        self,
        config: GPTConfig,
        tp_group: ProcessGroup,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(config.max_seq_len, config.hidden_size, device=device, dtype=dtype)
        )
        setattr(self.weight, INIT_ATTR, Normal(config.init_std))
        mark_replicated(self.weight, tp_group)


class GPTModel(nn.Module):
    """A GPT decoder split by ``groups`` (tp heads/FFN/vocab, cp sequence) and by ``stage``.

    ``forward(x, labels=None)``: on the first stage ``x`` is token ids ``[b, s_local]``
    (under context parallelism, this cp rank's zig-zag share of each sequence); on later
    stages it is the previous stage's hidden state ``[s(/tp), b, h]``. The last stage
    returns the per-token loss ``[b, s_local]`` when ``labels`` are given, else the logits
    ``[b, s_local, vocab/tp]`` (this rank's vocabulary slice, padding included); other
    stages return their hidden state. Weights are built on the meta device, then
    materialised on ``device`` and drawn from ``(seed, parameter name)`` — with global
    layer indices in the names — so every layout gets the same full weights.
    """

    def __init__(
        self,
        config: GPTConfig,
        groups: ProcessGroups,
        *,
        stage: StageSpec | None = None,
        sequence_parallel: bool = False,
        cp_method: Literal["ring", "all_gather"] = "ring",
        recompute: Recompute = "none",
        seed: int = 1234,
        rng: RNGStatesTracker | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp, cp = groups.size("tp"), groups.size("cp")
        if sequence_parallel and tp == 1:
            raise ValueError("sequence_parallel=True needs tp > 1; turn it off or raise tp")
        if recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute ({recompute!r}) must be 'none', 'selective' or 'full'")
        c = config
        for label, count in (
            ("num_attention_heads", c.num_attention_heads),
            ("num_query_groups", c.kv_heads),
        ):
            if count % tp:
                raise ValueError(
                    f"{label} ({count}) is not divisible by tp ({tp}); choose tp dividing {count}"
                )
        if c.attention_dropout > 0 and cp > 1:
            raise ValueError(
                f"attention_dropout ({c.attention_dropout}) is not supported with cp ({cp}) > 1; "
                "set it to 0 or use cp = 1"
            )
        self.config, self.groups = config, groups
        self.stage = stage if stage is not None else stage_spec(c.num_layers)
        self.sequence_parallel, self.recompute, self.rng = sequence_parallel, recompute, rng
        self.tp_group, self.cp_group = groups.tp, groups.cp
        self.cp = cp
        target = torch.device(device) if device is not None else torch.device("cpu")
        meta = torch.device("meta")
        sp = sequence_parallel
        self.embedding: _Embedding | None = None
        if self.stage.first or (self.stage.last and c.tie_embeddings):
            # the last stage of a tied model keeps a copy under the same name: same init,
            # and its gradient is summed with the first stage's (finalize_model_grads)
            self.embedding = _Embedding(c, groups.tp, sp, meta, dtype)
        self.layers = nn.ModuleDict({
            str(i): TransformerLayer(
                c, tp_group=groups.tp, cp_group=groups.cp, sequence_parallel=sp,
                cp_method=cp_method, recompute_core=recompute == "selective", rng=rng,
                layer_index=i, ep_group=groups.ep, etp_group=groups.etp, tp_cp_group=groups.tp_cp,
                device=meta, dtype=dtype,
            )
            for i in self.stage.layers
        })  # fmt: skip
        self.final_norm: Norm | None = None
        self.output: ColumnParallelLinear | None = None
        if self.stage.last:
            self.final_norm = Norm(c.hidden_size, c.norm, c.norm_eps, tp_group=groups.tp,
                                   partial_grads=sp, device=meta, dtype=dtype)  # fmt: skip
            if not c.tie_embeddings:
                self.output = ColumnParallelLinear(
                    c.hidden_size, c.vocab_size, tp_group=groups.tp, bias=False,
                    sequence_parallel=sp, pad_out_features=True,
                    init_method=Normal(c.init_std), device=meta, dtype=dtype,
                )  # fmt: skip
        self.to_empty(device=target)
        init_parameters(self, seed)
        if self.embedding is not None and not self.stage.first:
            # the tied copy on the last stage repeats the first stage's: count it once
            weight = self.embedding.word.weight
            spec = shard_spec(weight)
            assert spec is not None
            set_shard_spec(weight, dataclasses.replace(spec, duplicate=True))

    def _positions(self, local_len: int, device: torch.device) -> tuple[Tensor, int]:
        """Absolute positions of this rank's tokens, and the full sequence length."""
        seq_len = local_len * self.cp
        if self.cp == 1:
            return torch.arange(local_len, device=device), seq_len
        rank = torch.distributed.get_rank(self.cp_group)
        return zigzag_positions(seq_len, self.cp, rank, device=device), seq_len

    def forward(self, x: Tensor, labels: Tensor | None = None) -> Tensor:
        c = self.config
        if self.stage.first:
            assert self.embedding is not None
            ids = x.t()  # [b, s] -> [s, b]
            positions, seq_len = self._positions(ids.shape[0], ids.device)
            hidden = self.embedding.word(ids)  # -> [s(/tp), b, h]
            if self.embedding.position is not None:
                table = self.embedding.position.weight[positions].unsqueeze(1)  # [s, 1, h]
                if self.sequence_parallel:
                    table = scatter_to_sequence_region(table, self.tp_group)
                hidden = hidden + table
        else:
            hidden = x
            local = hidden.shape[0] * (
                torch.distributed.get_world_size(self.tp_group) if self.sequence_parallel else 1
            )
            positions, seq_len = self._positions(local, hidden.device)
        rope = (
            rope_tables(c.head_dim, positions, c.rope_theta, hidden.dtype)
            if c.position == "rope"
            else None
        )
        for layer in self.layers.values():
            if self.recompute == "full" and self.training:
                hidden = checkpoint(
                    layer, hidden, rope, seq_len, use_reentrant=False,
                    context_fn=rng_checkpoint_contexts(self.rng),
                )  # fmt: skip
            else:
                hidden = layer(hidden, rope, seq_len)
            assert isinstance(hidden, Tensor)
        if not self.stage.last:
            out: Tensor = hidden
            return out
        assert self.final_norm is not None
        return lm_head(
            hidden, labels, final_norm=self.final_norm, output=self.output,
            tied_weight=self.embedding.word.weight if self.embedding is not None else None,
            tp_group=self.tp_group, sequence_parallel=self.sequence_parallel,
            vocab_size=self.config.vocab_size,
        )  # fmt: skip
