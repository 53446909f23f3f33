"""What the trainer logs of a multi-token-prediction model: the MTP losses beside the loss."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from mega_parallel_grid import ProcessGroups

__all__ = ["mtp_log_values"]


def mtp_log_values(losses: Sequence[dict[str, Tensor]], groups: ProcessGroups) -> dict[str, float]:
    """The MTP losses of a step, as the logged ``loss`` is taken: mean over the global batch.

    ``losses`` are the step's per-micro-batch records on every pipeline rank (what
    :class:`~mega_pretrain.step.StepRunner` keeps in ``last_losses``). Call it on every rank
    (one all-reduce over dp x cp; nothing for a model without MTP, which gives ``{}``).
    Returns ``mtp_loss`` (the mean over the depths of each depth's loss, the mean of its
    cross entropy over the positions that have a target) and, for more than one depth,
    ``mtp_loss_k``. The logged ``loss`` stays the main language-model loss; the training
    loss is ``loss + model.mtp_loss_scale * mtp_loss``.
    """
    names = sorted(n for n in (losses[0] if losses else {}) if n.startswith("mtp_loss"))
    if not names:
        return {}
    values = torch.stack([torch.stack([r[n].float() for r in losses]).mean() for n in names])
    if groups.size("dp_cp") > 1:  # each cp rank holds its share scaled by cp, as the loss
        dist.all_reduce(values, group=groups.dp_cp)
        values /= groups.size("dp_cp")
    return {n: float(v) for n, v in zip(names, values.tolist(), strict=True)}
