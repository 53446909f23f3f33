"""Share the last stage's per-microbatch losses with every pipeline rank, for logging."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from mega_pipeline.p2p import group_device

__all__ = ["broadcast_losses"]


def _problem(losses: Sequence[dict[str, Tensor]]) -> str:
    """Why ``losses`` cannot be broadcast (one sentence), or ``""``."""
    names = sorted(losses[0]) if losses else []
    for i, record in enumerate(losses):
        if sorted(record) != names:
            return (
                "broadcast_losses needs every microbatch to log the same scalar names; "
                f"got {sorted(record)} after {names}"
            )
        shapes = {n: tuple(v.shape) for n, v in record.items() if v.numel() != 1}
        if shapes:
            return (
                f"broadcast_losses needs scalar values, but microbatch {i} logged {shapes}; "
                "log one number per name (e.g. the mean)"
            )
    return ""


def broadcast_losses(
    losses: Sequence[dict[str, Tensor]],
    pp_group: ProcessGroup,
    *,
    device: torch.device | str | None = None,
    src: int | None = None,
) -> list[dict[str, Tensor]]:
    """Give every rank of ``pp_group`` the losses the schedule returned on its last rank.

    Call on every rank of the group with what the schedule returned there (an empty list
    except on the last rank). Each value must be a scalar; they come back as fp32
    scalars on ``device`` (default: the current CUDA device under NCCL, else the CPU).
    Three small broadcasts; nothing is sent when the group has one rank. Records that
    cannot be shared raise the same ValueError on every rank. ``src``: the pp rank that
    holds the losses (default the last; 0 for the V schedules, ZBV and DualPipeV, whose
    last stage is rank 0's second chunk).
    """
    size = dist.get_world_size(pp_group)
    if device is None:
        device = group_device(pp_group)
    holder = size - 1 if src is None else src
    if not 0 <= holder < size:
        raise ValueError(f"src ({src}) must be a pp rank in 0..{size - 1}")
    is_src = dist.get_rank(pp_group) == holder
    problem = _problem(losses) if is_src else ""
    if size == 1:
        if problem:
            raise ValueError(problem)
        return [
            {n: r[n].detach().to(device, torch.float32).reshape(()) for n in sorted(r)}
            for r in losses
        ]
    src = dist.get_global_rank(pp_group, holder)
    names = sorted(losses[0]) if is_src and losses else []
    # a record the source cannot share travels as its error text, raised on every rank
    encoded = problem.encode() if problem else "\0".join(names).encode()
    header = torch.tensor(
        [len(losses), len(names), len(encoded), int(bool(problem))],
        dtype=torch.int64,
        device=device,
    )
    dist.broadcast(header, src, group=pp_group)
    m, k, nbytes, failed = (int(v) for v in header.tolist())
    if failed:
        text = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        if is_src:
            text.copy_(torch.tensor(list(encoded), dtype=torch.uint8))
        dist.broadcast(text, src, group=pp_group)
        raise ValueError(bytes(text.cpu().tolist()).decode())
    if m == 0 or k == 0:
        return [{} for _ in range(m)]
    values = torch.empty((m, k), dtype=torch.float32, device=device)
    text = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    if is_src:
        values.copy_(
            torch.stack([torch.stack([r[n].float().reshape(()) for n in names]) for r in losses])
        )
        text.copy_(torch.tensor(list(encoded), dtype=torch.uint8))
    dist.broadcast(values, src, group=pp_group)
    dist.broadcast(text, src, group=pp_group)
    names = bytes(text.cpu().tolist()).decode().split("\0")
    return [{n: values[i, j] for j, n in enumerate(names)} for i in range(m)]
