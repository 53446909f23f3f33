"""The ``forward_step`` mega-pipeline's schedules call, for GPT-style chunks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from mega_models.context_parallel import zigzag_split

__all__ = ["LossFunc", "gpt_forward_step"]

#: Turns the last stage's per-token loss into the micro-batch loss and the values to log.
LossFunc = Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]]


def gpt_forward_step(
    cp_group: ProcessGroup, device: torch.device
) -> Callable[[Iterator[tuple[Tensor, Tensor]] | None, Any], tuple[Tensor, LossFunc]]:
    """``forward_step(data_iterator, model_chunk)`` for GPTModel / HybridModel chunks.

    Each item of the iterator is ``(tokens, labels)``, ``[b, s]`` each, the same on every
    rank of a data-parallel replica; under context parallelism this rank keeps its zig-zag
    share. On later pipeline stages the schedule's chunk wrapper replaces the tokens by
    the received hidden state. The micro-batch loss is the mean over its tokens.
    """
    cp = torch.distributed.get_world_size(cp_group)
    cp_rank = torch.distributed.get_rank(cp_group)

    def forward_step(
        data: Iterator[tuple[Tensor, Tensor]] | None, chunk: Any
    ) -> tuple[Tensor, LossFunc]:
        assert data is not None
        tokens, labels = next(data)
        tokens = zigzag_split(tokens, cp, cp_rank, dim=1).to(device, non_blocking=True)
        labels = zigzag_split(labels, cp, cp_rank, dim=1).to(device, non_blocking=True)
        out: Tensor = chunk(tokens, labels=labels)

        def loss_func(per_token: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    return forward_step
