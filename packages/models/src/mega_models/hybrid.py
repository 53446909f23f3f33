"""HybridModel: a decoder whose layers (Mamba-2, attention, MLP, MoE) follow a pattern string."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from mega_models.attention import SelfAttention
from mega_models.head import Embedding, embed, lm_head, make_head, mark_tied_copy
from mega_models.hybrid_config import HybridConfig
from mega_models.layer import moe_mlp
from mega_models.mamba import Mamba2Mixer
from mega_models.mlp import MLP
from mega_models.norms import Norm
from mega_models.rope import rope_tables
from mega_models.stage_body import run_stage
from mega_models.stages import StageSpec, stage_spec
from mega_parallel_grid import ProcessGroups
from mega_tp_layers import (
    ColumnParallelLinear,
    RNGStatesTracker,
    init_parameters,
)

__all__ = ["HybridLayer", "HybridModel"]

Recompute = Literal["none", "selective", "full"]
_MIXER_NAMES = {"M": "mamba", "*": "attention", "-": "mlp", "E": "mlp"}


class HybridLayer(nn.Module):
    """``x + f(norm(x))`` on ``[s(/tp), b, h]``, ``f`` a Mamba-2 mixer (``M``),
    self-attention (``*``), an MLP (``-``) or a :class:`mega_moe.MoELayer` (``E``); the
    module is called ``mamba``, ``attention`` or ``mlp`` (both ``-`` and ``E``, as in
    GPT's layers) accordingly.

    An ``E`` layer is built exactly as GPT's MoE layers are: experts over ``ep_group`` /
    ``etp_group``, router losses as shares over ``tp_cp_group`` (default ``tp_group``)
    entering backward through its output with gradient ``mlp.aux_loss_scale``.
    """

    def __init__(
        self,
        kind: str,
        config: HybridConfig,
        *,
        tp_group: ProcessGroup,
        cp_group: ProcessGroup,
        sequence_parallel: bool,
        recompute_core: bool = False,
        rng: RNGStatesTracker | None = None,
        ep_group: ProcessGroup | None = None,
        etp_group: ProcessGroup | None = None,
        tp_cp_group: ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        c, sp = config, sequence_parallel
        self.kind = kind
        self.norm = Norm(c.hidden_size, c.norm, c.norm_eps, tp_group=tp_group, partial_grads=sp,
                         device=device, dtype=dtype)  # fmt: skip
        mixer: nn.Module
        if kind == "M":
            mixer = Mamba2Mixer(c, tp_group=tp_group, sequence_parallel=sp,
                                recompute_core=recompute_core, device=device, dtype=dtype)  # fmt: skip
        elif kind == "*":
            mixer = SelfAttention(c, tp_group=tp_group, cp_group=cp_group, sequence_parallel=sp,
                                  recompute_core=recompute_core, rng=rng, device=device,
                                  dtype=dtype)  # fmt: skip
        elif kind == "E":
            mixer = moe_mlp(c, tp_group=tp_group, sequence_parallel=sp, ep_group=ep_group,
                            etp_group=etp_group, tp_cp_group=tp_cp_group, device=device,
                            dtype=dtype)  # fmt: skip
        else:
            assert kind == "-", kind  # HybridConfig validated the pattern
            mixer = MLP(c, tp_group=tp_group, sequence_parallel=sp, device=device, dtype=dtype)
        self.mixer_name = _MIXER_NAMES[kind]
        self.add_module(self.mixer_name, mixer)
        self.hidden_dropout, self.sequence_parallel, self.rng = c.hidden_dropout, sp, rng

    def _dropout(self, x: Tensor) -> Tensor:
        if not self.training or self.hidden_dropout == 0.0:
            return x
        if self.sequence_parallel and self.rng is not None:
            with self.rng.fork():  # sequence shards differ per tp rank: so must the masks
                return F.dropout(x, self.hidden_dropout)
        return F.dropout(x, self.hidden_dropout)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None, seq_len: int) -> Tensor:
        y = self.norm(x)
        mixer = getattr(self, self.mixer_name)
        out: Tensor = mixer(y, rope, seq_len) if self.kind == "*" else mixer(y)
        return x + self._dropout(out)


class HybridModel(nn.Module):
    """A hybrid decoder split by ``groups`` (tp, sequence parallel) and by ``stage``.

    The same calling convention as :class:`~mega_models.GPTModel`: ``forward(x, labels=None)``
    takes token ids ``[b, s]`` on the first stage and the previous stage's hidden state
    ``[s(/tp), b, h]`` on the others; the last stage returns the per-token loss ``[b, s]``
    when ``labels`` are given, else the logits ``[b, s, vocab/tp]`` (this rank's vocabulary
    slice, padding included); other stages return their hidden state. Pipeline stages own
    pattern positions (``stage_spec(len(pattern), ...)``) and name their layers by global
    index, so every layout draws the same full weights from ``(seed, parameter name)``.
    Embedding, final norm and output layer are GPTModel's, under the same names.
    ``E`` layers put their experts over ``groups.ep`` / ``groups.etp`` (expert parameters
    carry mega-moe's expert metadata, see :func:`mega_moe.expert_shard`).
    Context parallelism is not supported (a Mamba scan needs the whole sequence).
    ``recompute="selective"`` recomputes the attention cores and the SSD scans in backward,
    ``"full"`` every layer.
    """

    def __init__(
        self,
        config: HybridConfig,
        groups: ProcessGroups,
        *,
        stage: StageSpec | None = None,
        sequence_parallel: bool = False,
        recompute: Recompute = "none",
        seed: int = 1234,
        rng: RNGStatesTracker | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        c = config
        if not isinstance(c, HybridConfig):
            raise TypeError(
                f"HybridModel needs a HybridConfig, got {type(c).__name__}; build one with "
                "HybridConfig(pattern=..., ...) or hybrid_config(name)"
            )
        tp, cp = groups.size("tp"), groups.size("cp")
        if cp > 1:
            raise ValueError(
                f"HybridModel does not support context parallelism (cp = {cp}): a Mamba scan "
                "needs the whole sequence; use cp = 1"
            )
        if sequence_parallel and tp == 1:
            raise ValueError("sequence_parallel=True needs tp > 1; turn it off or raise tp")
        if recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute ({recompute!r}) must be 'none', 'selective' or 'full'")
        checks = [("mamba_num_groups", c.mamba_num_groups)] if "M" in c.pattern else []
        if "*" in c.pattern:
            checks += [("num_attention_heads", c.num_attention_heads),
                       ("num_query_groups", c.kv_heads)]  # fmt: skip
        if "-" in c.pattern:
            checks.append(("ffn_hidden_size", c.ffn_size))
        for label, count in checks:
            if count % tp:
                raise ValueError(
                    f"{label} ({count}) is not divisible by tp ({tp}); choose tp dividing {count}"
                )
        self.config, self.groups = c, groups
        self.stage = stage if stage is not None else stage_spec(c.num_layers)
        self.sequence_parallel, self.recompute, self.rng = sequence_parallel, recompute, rng
        self.tp_group = groups.tp
        target = torch.device(device) if device is not None else torch.device("cpu")
        meta = torch.device("meta")
        sp = sequence_parallel
        self.embedding: Embedding | None = None
        if self.stage.first or (self.stage.last and c.tie_embeddings):
            self.embedding = Embedding(
                c, groups.tp, sp, meta, dtype, positions=self.stage.first
            )  # tied: summed over pp
        layer_kw: dict[str, Any] = {"tp_group": groups.tp, "cp_group": groups.cp,
                                    "sequence_parallel": sp, "recompute_core":
                                    recompute == "selective", "rng": rng, "ep_group": groups.ep,
                                    "etp_group": groups.etp, "tp_cp_group": groups.tp_cp,
                                    "device": meta, "dtype": dtype}  # fmt: skip
        self.layers = nn.ModuleDict(
            {str(i): HybridLayer(c.pattern[i], c, **layer_kw) for i in self.stage.layers}
        )
        self.head_fn: Callable[..., Tensor] = lm_head  # build() may compile it
        self.final_norm: Norm | None = None
        self.output: ColumnParallelLinear | None = None
        if self.stage.last:
            self.final_norm, self.output = make_head(c, groups.tp, sp, meta, dtype)
        self.to_empty(device=target)
        init_parameters(self, seed)
        if self.embedding is not None and not self.stage.first:
            mark_tied_copy(self.embedding.word.weight)

    def forward(self, x: Tensor, labels: Tensor | None = None) -> Tensor:
        c = self.config
        if self.stage.first:
            assert self.embedding is not None
            ids = x.t()  # [b, s] -> [s, b]
            seq_len = ids.shape[0]
            hidden = embed(
                self.embedding, ids, torch.arange(seq_len, device=ids.device),
                sequence_parallel=self.sequence_parallel, tp_group=self.tp_group,
            )  # fmt: skip
        else:
            hidden = x
            tp = torch.distributed.get_world_size(self.tp_group)
            seq_len = hidden.shape[0] * (tp if self.sequence_parallel else 1)
        rope = None
        if c.position == "rope" and any(layer.kind == "*" for layer in self._layers()):
            positions = torch.arange(seq_len, device=hidden.device)
            rope = rope_tables(c.head_dim, positions, c.rope_theta, hidden.dtype)
        return run_stage(self, self._layers(), hidden, labels, rope, seq_len)

    def _layers(self) -> list[HybridLayer]:
        return [layer for layer in self.layers.values() if isinstance(layer, HybridLayer)]
