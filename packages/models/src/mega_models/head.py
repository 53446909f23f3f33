"""The model's two ends, shared by GPTModel and HybridModel: embedding lookup and the head."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from mega_models.config import GPTConfig
from mega_models.norms import Norm
from mega_tp_layers import (
    INIT_ATTR,
    ColumnParallelLinear,
    KeepsParamAttrs,
    Normal,
    VocabParallelEmbedding,
    column_parallel_linear,
    fused_linear_cross_entropy,
    mark_replicated,
    scatter_to_sequence_region,
    set_shard_spec,
    shard_spec,
    vocab_parallel_cross_entropy,
)

__all__ = ["Embedding", "Positions", "embed", "lm_head", "make_head", "mark_tied_copy"]


class Embedding(nn.Module):
    """Token embedding (vocab-parallel) plus an optional learned position table.

    ``positions=False`` leaves the table out: the copy a tied model's last pipeline stage
    keeps for its output layer needs the word embedding only (a table there would get no
    gradient but weight decay, and drift from the first stage's).
    """

    def __init__(
        self,
        config: GPTConfig,
        tp_group: ProcessGroup,
        sp: bool,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        *,
        positions: bool = True,
    ) -> None:
        super().__init__()
        self.word = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_group=tp_group, sequence_parallel=sp,
            init_method=Normal(config.init_std), device=device, dtype=dtype,
        )  # fmt: skip
        self.position: Positions | None = None
        if config.position == "learned" and positions:
            self.position = Positions(config, tp_group, device, dtype)


class Positions(KeepsParamAttrs):
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


def embed(
    embedding: Embedding,
    ids: Tensor,
    positions: Tensor,
    *,
    sequence_parallel: bool,
    tp_group: ProcessGroup,
) -> Tensor:
    """``[s, b]`` ids at absolute ``positions`` -> ``[s(/tp), b, h]``: tokens + learned positions."""
    hidden: Tensor = embedding.word(ids)  # -> [s(/tp), b, h]
    if embedding.position is not None:
        table = embedding.position.weight[positions].unsqueeze(1)  # [s, 1, h]
        if sequence_parallel:
            table = scatter_to_sequence_region(table, tp_group)
        hidden = hidden + table
    return hidden


def make_head(
    config: GPTConfig,
    tp_group: ProcessGroup,
    sequence_parallel: bool,
    device: torch.device,
    dtype: torch.dtype | None,
) -> tuple[Norm, ColumnParallelLinear | None]:
    """The final norm and, unless the embedding is tied, the vocab-parallel output layer."""
    c = config
    norm = Norm(c.hidden_size, c.norm, c.norm_eps, tp_group=tp_group,
                partial_grads=sequence_parallel, device=device, dtype=dtype)  # fmt: skip
    if c.tie_embeddings:
        return norm, None
    output = ColumnParallelLinear(
        c.hidden_size, c.vocab_size, tp_group=tp_group, bias=False,
        sequence_parallel=sequence_parallel, pad_out_features=True,
        init_method=Normal(c.init_std), device=device, dtype=dtype,
    )  # fmt: skip
    return norm, output


def mark_tied_copy(weight: Tensor) -> None:
    """The tied copy on the last stage repeats the first stage's: count it once in norms."""
    spec = shard_spec(weight)
    assert spec is not None
    set_shard_spec(weight, dataclasses.replace(spec, duplicate=True))


def lm_head(
    hidden: Tensor,
    labels: Tensor | None,
    *,
    final_norm: nn.Module,
    output: ColumnParallelLinear | None,
    tied_weight: Tensor | None,
    tp_group: ProcessGroup,
    sequence_parallel: bool,
    vocab_size: int,
    loss_chunk_size: int = 0,
) -> Tensor:
    """``[s(/tp), b, h]`` -> per-token loss ``[b, s]`` with ``labels``, else logits ``[b, s, V_pad/tp]``.

    ``loss_chunk_size`` > 0 computes the loss with
    :func:`~mega_tp_layers.fused_linear_cross_entropy`, that many tokens at a time: the
    same loss and gradients (to rounding) without the ``[s, b, V_pad/tp]`` logits, at the
    cost of recomputing each chunk's logits in backward. 0: the output layer, then the loss.
    """
    hidden = final_norm(hidden)
    if labels is not None and loss_chunk_size > 0:
        weight = output.weight if output is not None else tied_weight
        assert weight is not None
        loss = fused_linear_cross_entropy(
            hidden, weight, labels.t(), tp_group, sequence_parallel=sequence_parallel,
            chunk_size=loss_chunk_size, vocab_size=vocab_size,
        )  # fmt: skip
        return loss.t()  # [s, b] -> [b, s]
    logits: Tensor
    if output is not None:
        logits = output(hidden)  # [s(/tp), b, h] -> [s, b, V_pad/tp]
    else:
        assert tied_weight is not None
        logits = column_parallel_linear(
            hidden, tied_weight, tp_group=tp_group, sequence_parallel=sequence_parallel
        )
    if labels is None:
        return logits.transpose(0, 1)  # [b, s, V_pad/tp]
    loss = vocab_parallel_cross_entropy(logits, labels.t(), tp_group, vocab_size=vocab_size)
    return loss.t()  # [s, b] -> [b, s]
