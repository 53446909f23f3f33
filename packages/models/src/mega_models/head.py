"""The last stage's head: final norm, output layer (own or tied), then logits or per-token loss."""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from mega_tp_layers import (
    ColumnParallelLinear,
    column_parallel_linear,
    vocab_parallel_cross_entropy,
)

__all__ = ["lm_head"]


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
) -> Tensor:
    """``[s(/tp), b, h]`` -> per-token loss ``[b, s]`` with ``labels``, else logits ``[b, s, V_pad/tp]``."""
    hidden = final_norm(hidden)
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
