"""GPTModel: the whole decoder, or the chunk of it that one pipeline stage owns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

from mega_models.config import GPTConfig
from mega_models.context_parallel import zigzag_positions, zigzag_split
from mega_models.doc_mask import DocumentMask, Documents, document_mask
from mega_models.head import Embedding, embed, lm_head, make_head, mark_tied_copy
from mega_models.layer import TransformerLayer
from mega_models.mtp import MTPDepth, mtp_head
from mega_models.norms import Norm
from mega_models.overlap import OverlappedStage
from mega_models.rope import rope_for
from mega_models.stage_body import run_stage
from mega_models.stages import StageSpec, stage_spec
from mega_parallel_grid import ProcessGroups
from mega_tp_layers import (
    ColumnParallelLinear,
    Fp8Recipe,
    RNGStatesTracker,
    init_parameters,
)

__all__ = ["GPTModel"]

Recompute = Literal["none", "selective", "full"]


class GPTModel(OverlappedStage, nn.Module):
    """A GPT decoder split by ``groups`` (tp heads/FFN/vocab, cp sequence) and by ``stage``.

    ``forward(x, labels=None)``: on the first stage ``x`` is token ids ``[b, s_local]``
    (under context parallelism, this cp rank's zig-zag share of each sequence); on later
    stages it is the previous stage's hidden state ``[s(/tp), b, h]``. The last stage
    returns the per-token loss ``[b, s_local]`` when ``labels`` are given, else the logits
    ``[b, s_local, vocab/tp]`` (this rank's vocabulary slice, padding included); other
    stages return their hidden state. Weights are built on the meta device, then
    materialised on ``device`` and drawn from ``(seed, parameter name)`` — with global
    layer indices in the names — so every layout gets the same full weights. ``fp8`` runs
    the transformer layers' linear GEMMs in FP8; embedding and output head stay as they are.
    ``tp_comm_overlap`` (needs ``sequence_parallel``) overlaps the layers' sequence-parallel
    all-gathers and reduce-scatters with their linear GEMMs (the output head stays plain).

    Multi-token prediction (``config.mtp_num_layers`` D > 0, :mod:`mega_models.mtp`): the
    last stage also holds D depth modules and a copy of the embedding; with labels its
    per-token loss carries the MTP term into backward, ``labels`` may be
    :func:`~mega_models.mtp.mtp_labels`' ``[1 + D, b, s_local]`` rows (needed under cp),
    and ``mtp_losses`` holds each depth's loss of the last forward. Without labels it
    returns the main logits only. ``mtp=False`` builds the model without them (inference,
    export): the same main weights, and ``mtp_depth`` 0.

    Packed documents (``documents``, :mod:`mega_models.doc_mask`, over the whole sequence
    before the cp split, given to every stage): rope positions restart in each document
    and attention stays inside it, as each says.
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
        fp8: Fp8Recipe | None = None,
        tp_comm_overlap: bool = False,
        mtp: bool = True,
    ) -> None:
        super().__init__()
        tp, cp = groups.size("tp"), groups.size("cp")
        if sequence_parallel and tp == 1:
            raise ValueError("sequence_parallel=True needs tp > 1; turn it off or raise tp")
        if tp_comm_overlap and not sequence_parallel:
            raise ValueError(
                "tp_comm_overlap=True overlaps the sequence-parallel collectives, so it needs "
                "sequence_parallel=True (and tp > 1); turn it off or enable sequence parallel"
            )
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
        self.mtp_depth = c.mtp_num_layers if mtp else 0
        if self.mtp_depth and c.position == "learned":
            raise ValueError(
                f"mtp_num_layers ({c.mtp_num_layers}) needs position 'rope' or 'none': the MTP "
                "depths embed their tokens without the learned position table; change position "
                "or set mtp_num_layers to 0"
            )
        self.config, self.groups = config, groups
        self.stage = stage if stage is not None else stage_spec(c.num_layers)
        self.sequence_parallel, self.recompute, self.rng = sequence_parallel, recompute, rng
        self.tp_group, self.cp_group = groups.tp, groups.cp
        self.cp = cp
        target = torch.device(device) if device is not None else torch.device("cpu")
        meta = torch.device("meta")
        sp = sequence_parallel
        self.shared_embedding = c.tie_embeddings or self.mtp_depth > 0
        """The last stage uses the embedding too (tied output layer, MTP): under pp it keeps
        a copy whose gradient finalize_model_grads sums with the first stage's."""
        self.embedding: Embedding | None = None
        if self.stage.first or (self.stage.last and self.shared_embedding):
            # the last stage keeps a copy under the same name: same init, and its gradient
            # is summed with the first stage's (finalize_model_grads)
            self.embedding = Embedding(c, groups.tp, sp, meta, dtype, positions=self.stage.first)
        self.layers = nn.ModuleDict({
            str(i): TransformerLayer(
                c, tp_group=groups.tp, cp_group=groups.cp, sequence_parallel=sp,
                cp_method=cp_method, recompute_core=recompute == "selective", rng=rng,
                layer_index=i, ep_group=groups.ep, etp_group=groups.etp, tp_cp_group=groups.tp_cp,
                device=meta, dtype=dtype, fp8=fp8, tp_comm_overlap=tp_comm_overlap,
            )
            for i in self.stage.layers
        })  # fmt: skip
        self.head_fn: Callable[..., Tensor] = lm_head  # build() may compile it
        self.final_norm: Norm | None = None
        self.output: ColumnParallelLinear | None = None
        if self.stage.last:
            self.final_norm, self.output = make_head(c, groups.tp, sp, meta, dtype)
        self.mtp: nn.ModuleList | None = None
        self.mtp_losses: Tensor | None = None
        if self.stage.last and self.mtp_depth:
            self.mtp = nn.ModuleList(
                MTPDepth(
                    c, tp_group=groups.tp, cp_group=groups.cp, sequence_parallel=sp,
                    cp_method=cp_method, recompute_core=recompute == "selective", rng=rng,
                    ep_group=groups.ep, etp_group=groups.etp, tp_cp_group=groups.tp_cp,
                    device=meta, dtype=dtype, fp8=fp8, tp_comm_overlap=tp_comm_overlap,
                )
                for _ in range(self.mtp_depth)
            )  # fmt: skip
        self.to_empty(device=target)
        init_parameters(self, seed)
        if self.embedding is not None and not self.stage.first:
            mark_tied_copy(self.embedding.word.weight)

    def _positions(self, local_len: int, device: torch.device) -> tuple[Tensor, int]:
        """Absolute positions of this rank's tokens, and the full sequence length."""
        seq_len = local_len * self.cp
        if self.cp == 1:
            return torch.arange(local_len, device=device), seq_len
        rank = torch.distributed.get_rank(self.cp_group)
        return zigzag_positions(seq_len, self.cp, rank, device=device), seq_len

    def _documents(
        self, documents: Documents | None, positions: Tensor, device: torch.device
    ) -> tuple[Tensor, DocumentMask | None]:
        """Rope positions (``[s_local]``, or ``[s_local, b]`` restarting per document) and
        this rank's document mask, if any."""
        if documents is None:
            return positions, None
        learned = self.config.position == "learned" and documents.positions is not None
        if self.mtp_depth or learned:
            raise ValueError(
                f"packed documents need no MTP (mtp_num_layers {self.mtp_depth}) and, to reset "
                f"positions, position 'rope' or 'none' ({self.config.position!r}); change the "
                "model or turn data.reset_position_ids / reset_attention_mask off"
            )
        cp_rank = torch.distributed.get_rank(self.cp_group) if self.cp > 1 else 0
        if documents.positions is not None:  # [b, s] -> [s_local, b]
            positions = zigzag_split(documents.positions.to(device), self.cp, cp_rank, dim=1).t()
        mask = None
        if documents.ids is not None:
            mask = document_mask(documents.ids.to(device), cp=self.cp, cp_rank=cp_rank)
        return positions, mask

    def forward(
        self, x: Tensor, labels: Tensor | None = None, documents: Documents | None = None
    ) -> Tensor:
        c = self.config
        if self.stage.first:
            assert self.embedding is not None
            ids = x.t()  # [b, s] -> [s, b]
            positions, seq_len = self._positions(ids.shape[0], ids.device)
            hidden = embed(
                self.embedding, ids, positions,
                sequence_parallel=self.sequence_parallel, tp_group=self.tp_group,
            )  # fmt: skip
        else:
            hidden = x
            local = hidden.shape[0] * (
                torch.distributed.get_world_size(self.tp_group) if self.sequence_parallel else 1
            )
            positions, seq_len = self._positions(local, hidden.device)
        rope_positions, mask = self._documents(documents, positions, hidden.device)
        rope = rope_for(c, rope_positions, hidden.dtype)
        if self.mtp is None or labels is None:
            return run_stage(
                self, self.layers.values(), hidden, labels, rope, seq_len, documents=mask
            )
        hidden = run_stage(self, self.layers.values(), hidden, None, rope, seq_len, head=False)
        return mtp_head(self, hidden, labels, rope, seq_len)
