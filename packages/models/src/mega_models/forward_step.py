"""The ``forward_step`` mega-pipeline's schedules call, for GPT-style chunks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from mega_models.context_parallel import zigzag_split
from mega_models.doc_mask import DocumentPacking, loss_mask
from mega_models.mtp import mtp_labels

__all__ = ["LossFunc", "gpt_forward_step"]

#: Turns the last stage's per-token loss into the micro-batch loss and the values to log.
LossFunc = Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]]


def gpt_forward_step(
    cp_group: ProcessGroup, device: torch.device, packing: DocumentPacking | None = None
) -> Callable[[Iterator[tuple[Tensor, ...]] | None, Any], tuple[Tensor, LossFunc]]:
    """``forward_step(data_iterator, model_chunk)`` for GPTModel / HybridModel chunks.

    Each item of the iterator is ``(tokens, labels)``, ``[b, s]`` each, the same on every
    rank of a data-parallel replica; under context parallelism this rank keeps its zig-zag
    share. On later pipeline stages the schedule's chunk wrapper replaces the tokens by
    the received hidden state. The micro-batch loss is the mean over its tokens.

    A model with multi-token prediction (``mtp_depth`` D > 0) gets the labels as
    :func:`~mega_models.mtp.mtp_labels`' ``[1 + D, b, s]`` rows, shifted before the split,
    so the shifted tokens cross cp chunk borders correctly. Its loss is the main loss plus
    the MTP term the model attached; the logged ``loss`` stays the main language-model
    loss, beside ``mtp_loss`` (the mean over depths) and, for D > 1, ``mtp_loss_k``.
    """
    cp = torch.distributed.get_world_size(cp_group)
    cp_rank = torch.distributed.get_rank(cp_group)

    def forward_step(
        data: Iterator[tuple[Tensor, ...]] | None, chunk: Any
    ) -> tuple[Tensor, LossFunc]:
        assert data is not None
        item = next(data)
        tokens, labels = item[0], item[1]
        module = getattr(chunk, "module", chunk)  # mega-pipeline's StageChunk wraps it
        depth = int(getattr(module, "mtp_depth", 0))
        if depth:
            labels = mtp_labels(labels, depth)  # [b, s] -> [1 + D, b, s]
        kwargs: dict[str, Any] = {}
        counted: Tensor | None = None
        denominator = 1.0
        if packing is not None:
            full = tokens.to(device, non_blocking=True)  # [b, s], before the cp split
            if packing.needs_documents:
                kwargs["documents"] = packing.documents(full)
            if packing.eod_mask_loss:
                keep = loss_mask(full, packing.eod_id)
                total = float(item[2]) if len(item) > 2 else float(keep.sum())
                counted = zigzag_split(keep, cp, cp_rank, dim=1)
                denominator = max(total, 1.0) / cp
        tokens = zigzag_split(tokens, cp, cp_rank, dim=1).to(device, non_blocking=True)
        labels = zigzag_split(labels, cp, cp_rank, dim=labels.dim() - 1)
        labels = labels.to(device, non_blocking=True)
        out: Tensor = chunk(tokens, labels=labels, **kwargs)
        mtp: Tensor | None = getattr(module, "mtp_losses", None) if depth else None

        def loss_func(per_token: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            if counted is None:
                loss = per_token.float().mean()
            else:  # [b, s/cp] summed where counted, over the step's share of the count
                loss = torch.where(counted, per_token.float(), 0.0).sum() / denominator
            logs = {"loss": loss.detach()}
            if mtp is not None:
                logs["mtp_loss"] = mtp.mean()
                if len(mtp) > 1:
                    logs.update({f"mtp_loss_{k}": v for k, v in enumerate(mtp, start=1)})
            return loss, logs

        return out, loss_func

    return forward_step
