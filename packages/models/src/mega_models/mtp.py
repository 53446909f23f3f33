"""Multi-token prediction (DeepSeek-V3 §2.2): D depth modules after the decoder, last stage only.

Depth k (1..D) predicts token ``t + k + 1`` at position ``t``. It takes the previous
depth's hidden state ``h^{k-1}`` (``h^0``: the decoder's output before the final norm) and
the embedding of token ``t + k``, and computes

    h^k = layer(eh_proj([enorm(emb(t + k)); hnorm(h^{k-1})]))    # embedding first, as
    logits^k = output(final_norm(h^k))                            # Megatron and DeepSeek do

with the model's own embedding and output layer (shared, not copied: on a pp > 1 last
stage the embedding is a tied copy whose gradient is summed with the first stage's).
``h^k`` goes on to depth k + 1 before its final norm, as ``h^0`` does (Megatron passes it
after; the two agree for D = 1). The layer is the model's TransformerLayer of the kind of
the decoder's last layer (Megatron's rule: an MoE model's MTP layer is MoE when its last
layer is, as DeepSeek-V3's is); ``eh_proj`` is replicated over tp (FP8 with ``fp8``).

Parameter names are stable for checkpoints and converters: ``mtp.{k-1}.enorm``,
``.hnorm``, ``.eh_proj``, ``.layer.*`` (the layer's own names), ``.final_norm``
(DeepSeek's ``shared_head.norm``).

The loss: ``main + mtp_loss_scale * mean_k(loss_k)``, each ``loss_k`` the mean of depth k's
cross entropy over the ``b * (s - k)`` positions that have a target (the last k of each
sequence have none). The model still returns the main per-token loss; the MTP term is
attached to it and enters backward with the weight the main loss's tokens carry together
(see :class:`_WithMTPLoss`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn
from torch.autograd import Function
from torch.distributed import ProcessGroup

from mega_models.config import GPTConfig
from mega_models.layer import TransformerLayer
from mega_models.norms import Norm
from mega_models.replicated_linear import ReplicatedLinear
from mega_models.stage_body import run_layer
from mega_tp_layers import Fp8Recipe, Normal, RNGStatesTracker

if TYPE_CHECKING:
    from mega_models.gpt import GPTModel

__all__ = ["IGNORE_INDEX", "MTPDepth", "check_mtp_depth", "mtp_head", "mtp_labels"]

#: Target of a position with no token to predict (the cross entropy gives it 0).
IGNORE_INDEX = -100


class MTPDepth(nn.Module):
    """One MTP depth: the two norms, ``eh_proj`` (2h -> h), one transformer layer, its final norm."""

    def __init__(
        self,
        config: GPTConfig,
        *,
        tp_group: ProcessGroup,
        cp_group: ProcessGroup,
        sequence_parallel: bool,
        cp_method: Literal["ring", "all_gather"],
        recompute_core: bool,
        rng: RNGStatesTracker | None,
        ep_group: ProcessGroup | None,
        etp_group: ProcessGroup | None,
        tp_cp_group: ProcessGroup | None,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        fp8: Fp8Recipe | None,
        tp_comm_overlap: bool,
    ) -> None:
        super().__init__()
        c, sp = config, sequence_parallel
        norm: dict[str, Any] = {"tp_group": tp_group, "partial_grads": sp,
                                "device": device, "dtype": dtype}  # fmt: skip
        self.enorm = Norm(c.hidden_size, c.norm, c.norm_eps, **norm)
        self.hnorm = Norm(c.hidden_size, c.norm, c.norm_eps, **norm)
        self.eh_proj = ReplicatedLinear(
            2 * c.hidden_size, c.hidden_size, tp_group=tp_group, sequence_parallel=sp,
            init_method=Normal(c.init_std), device=device, dtype=dtype, fp8=fp8,
        )  # fmt: skip
        self.layer = TransformerLayer(
            c, tp_group=tp_group, cp_group=cp_group, sequence_parallel=sp, cp_method=cp_method,
            recompute_core=recompute_core, rng=rng, layer_index=c.num_layers - 1,
            ep_group=ep_group, etp_group=etp_group, tp_cp_group=tp_cp_group, device=device,
            dtype=dtype, fp8=fp8, tp_comm_overlap=tp_comm_overlap,
        )  # fmt: skip
        self.final_norm = Norm(c.hidden_size, c.norm, c.norm_eps, **norm)

    def combine(self, embedded: Tensor, hidden: Tensor) -> Tensor:
        """``[s(/tp), b, h]`` twice -> the layer's input ``[s(/tp), b, h]``."""
        both = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)  # [s(/tp), b, 2h]
        out: Tensor = self.eh_proj(both)
        return out


def check_mtp_depth(depth: int, seq_len: int) -> None:
    """Raise unless sequences of ``seq_len`` tokens leave every depth a target to predict."""
    if seq_len <= depth:
        raise ValueError(
            f"mtp_num_layers ({depth}) needs sequences longer than {depth} tokens (depth k "
            f"predicts token t + k + 1); got sequences of {seq_len}: lengthen them or lower "
            "mtp_num_layers"
        )


def mtp_labels(labels: Tensor, depth: int) -> Tensor:
    """``[b, s]`` next-token labels -> ``[1 + depth, b, s]``: row j is shifted left by j.

    Row 0 is ``labels``; row j holds token ``t + j + 1`` at position ``t`` and
    :data:`IGNORE_INDEX` at the last j positions. Depth k reads its input tokens from row
    k - 1 (token ``t + k``) and its targets from row k. Shift whole sequences, before any
    context-parallel split (:func:`~mega_models.gpt_forward_step` does).
    """
    if labels.dim() != 2:
        raise ValueError(f"mtp_labels takes [batch, seq] labels; got shape {tuple(labels.shape)}")
    check_mtp_depth(depth, labels.shape[1])
    rows = [labels]
    for j in range(1, depth + 1):
        pad = labels.new_full((labels.shape[0], j), IGNORE_INDEX)
        rows.append(torch.cat([labels[:, j:], pad], dim=1))
    return torch.stack(rows)


def _label_rows(labels: Tensor, depth: int, cp: int) -> Tensor:
    if labels.dim() == 3 and labels.shape[0] == depth + 1:
        return labels
    if labels.dim() == 2 and cp == 1:
        return mtp_labels(labels, depth)
    if labels.dim() == 2:
        raise ValueError(
            f"under context parallelism (cp {cp}) an MTP model needs its labels shifted before "
            "the zig-zag split: pass mtp_labels(labels, mtp_num_layers), split along dim 2"
        )
    raise ValueError(
        f"labels of shape {tuple(labels.shape)} fit neither [b, s] nor mtp_labels' "
        f"[1 + mtp_num_layers, b, s] = [{depth + 1}, b, s]"
    )


class _WithMTPLoss(Function):
    """fwd: the main per-token loss unchanged · bwd: its gradient, and to the MTP loss the sum
    of that gradient (the weight the main loss's tokens carry together: 1 for ``.mean()``)"""

    @staticmethod
    def forward(ctx: Any, per_token: Tensor, mtp_loss: Tensor) -> Tensor:
        ctx.dtype = mtp_loss.dtype
        return per_token

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, grad.float().sum().to(ctx.dtype)


def mtp_head(
    model: GPTModel,
    hidden: Tensor,
    labels: Tensor,
    rope: tuple[Tensor, Tensor] | None,
    seq_len: int,
) -> Tensor:
    """The last stage's head with MTP: the main per-token loss ``[b, s_local]``, the
    MTP term attached (:class:`_WithMTPLoss`), each depth's loss kept detached in
    ``model.mtp_losses`` (``[D]``).

    ``hidden`` is the decoder's output before the final norm, ``[s(/tp), b, h]``;
    ``labels`` are ``[b, s]`` (cp 1) or :func:`mtp_labels`' rows, this cp rank's share.
    Under cp each rank's ``loss_k`` is its share of the sum over the valid positions,
    scaled by cp, so that the mean over the cp ranks (the DDP's) is the sequence's.
    """
    assert model.mtp is not None and model.final_norm is not None
    c = model.config
    rows = _label_rows(labels, len(model.mtp), model.cp)
    check_mtp_depth(len(model.mtp), seq_len)
    tied = model.embedding.word.weight if model.embedding is not None else None
    head: dict[str, Any] = {"output": model.output, "tied_weight": tied, "tp_group": model.tp_group,
                            "sequence_parallel": model.sequence_parallel,
                            "vocab_size": c.vocab_size}  # fmt: skip
    main = model.head_fn(hidden, rows[0], final_norm=model.final_norm, **head)  # [b, s_local]
    assert model.embedding is not None
    batch = rows.shape[1]
    losses = []
    for k, depth in enumerate(model.mtp, start=1):
        assert isinstance(depth, MTPDepth)
        ids = rows[k - 1].clamp_min(0).t()  # token t + k at position t: [b, s] -> [s, b]
        embedded = model.embedding.word(ids)  # [s(/tp), b, h]
        hidden = run_layer(model, depth.layer, depth.combine(embedded, hidden), rope, seq_len)
        per_token = model.head_fn(hidden, rows[k], final_norm=depth.final_norm, **head)
        losses.append(per_token.float().sum() * (model.cp / (batch * (seq_len - k))))
    stacked = torch.stack(losses)  # [D]
    model.mtp_losses = stacked.detach()
    total = stacked.mean() * c.mtp_loss_scale
    out: Tensor = _WithMTPLoss.apply(main, total)
    return out
