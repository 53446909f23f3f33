"""One pre-norm transformer layer."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from mega_models.attention import SelfAttention
from mega_models.config import GPTConfig
from mega_models.doc_mask import DocumentMask
from mega_models.mla import MultiLatentAttention
from mega_models.mlp import MLP
from mega_models.norms import Norm
from mega_moe import MoELayer
from mega_tp_layers import Fp8Recipe, Normal, RNGStatesTracker, ScaledNormal

__all__ = ["TransformerLayer", "moe_mlp"]


def moe_mlp(
    config: GPTConfig,
    *,
    tp_group: ProcessGroup,
    sequence_parallel: bool,
    ep_group: ProcessGroup | None,
    etp_group: ProcessGroup | None,
    tp_cp_group: ProcessGroup | None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> MoELayer:
    """The :class:`mega_moe.MoELayer` that stands in for the MLP of an MoE layer.

    Experts over ``ep_group`` / ``etp_group``; router losses as shares over ``tp_cp_group``
    (default ``tp_group``); the same init as the dense MLP (output side scaled by depth).
    """
    c = config
    return MoELayer(
        c.hidden_size, c.moe_config(), ep_group=ep_group, etp_group=etp_group,
        tp_group=tp_group, sequence_parallel=sequence_parallel,
        sequence_group=tp_group if tp_cp_group is None else tp_cp_group,
        init_method=Normal(c.init_std),
        output_init_method=ScaledNormal(c.init_std, c.num_layers),
        device=device, dtype=dtype,
    )  # fmt: skip


class TransformerLayer(nn.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))`` on ``[s(/tp), b, h]``.

    On an MoE layer (``config.is_moe_layer(layer_index)``) ``mlp`` is a
    :class:`mega_moe.MoELayer` over ``ep_group`` / ``etp_group``; its router losses are
    shares over ``tp_cp_group`` (the ranks holding parts of the same sequences) and enter
    backward through its output, with gradient ``mlp.aux_loss_scale`` (1 by default: the
    loss is the language-model loss plus the router losses). ``fp8`` runs the attention and
    dense MLP GEMMs in FP8 (MoE experts stay in high precision). ``config.attention``
    picks :class:`SelfAttention` (``mha``) or :class:`MultiLatentAttention` (``mla``).
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        tp_group: ProcessGroup,
        cp_group: ProcessGroup,
        sequence_parallel: bool,
        cp_method: Literal["ring", "all_gather"] = "ring",
        recompute_core: bool = False,
        rng: RNGStatesTracker | None = None,
        layer_index: int = 0,
        ep_group: ProcessGroup | None = None,
        etp_group: ProcessGroup | None = None,
        tp_cp_group: ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        fp8: Fp8Recipe | None = None,
        tp_comm_overlap: bool = False,
    ) -> None:
        super().__init__()
        c = config
        norm_kw: dict[str, Any] = {"tp_group": tp_group, "partial_grads": sequence_parallel,
                                   "device": device, "dtype": dtype}  # fmt: skip
        self.input_norm = Norm(c.hidden_size, c.norm, c.norm_eps, **norm_kw)
        attention = MultiLatentAttention if c.attention == "mla" else SelfAttention
        self.attention: SelfAttention | MultiLatentAttention = attention(
            c, tp_group=tp_group, cp_group=cp_group, sequence_parallel=sequence_parallel,
            cp_method=cp_method, recompute_core=recompute_core, rng=rng, device=device, dtype=dtype,
            fp8=fp8, tp_comm_overlap=tp_comm_overlap,
        )  # fmt: skip
        self.mlp_norm = Norm(c.hidden_size, c.norm, c.norm_eps, **norm_kw)
        self.mlp: MLP | MoELayer
        if c.is_moe_layer(layer_index):
            self.mlp = moe_mlp(
                c, tp_group=tp_group, sequence_parallel=sequence_parallel, ep_group=ep_group,
                etp_group=etp_group, tp_cp_group=tp_cp_group, device=device, dtype=dtype,
            )  # fmt: skip
        else:
            self.mlp = MLP(
                c, tp_group=tp_group, sequence_parallel=sequence_parallel, device=device,
                dtype=dtype, fp8=fp8, tp_comm_overlap=tp_comm_overlap,
            )  # fmt: skip
        self.hidden_dropout = c.hidden_dropout
        self.sequence_parallel = sequence_parallel
        self.rng = rng

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.hidden_dropout == 0.0:
            return x
        if self.sequence_parallel and self.rng is not None:
            with self.rng.fork():  # sequence shards differ per tp rank: so must the masks
                return F.dropout(x, self.hidden_dropout)
        return F.dropout(x, self.hidden_dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        seq_len: int,
        documents: DocumentMask | None = None,
    ) -> torch.Tensor:
        x = x + self._dropout(self.attention(self.input_norm(x), rope, seq_len, documents))
        return x + self._dropout(self.mlp(self.mlp_norm(x)))
