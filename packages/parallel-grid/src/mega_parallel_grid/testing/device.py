"""The device a pooled call should put its tensors on."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["rank_device"]


def rank_device() -> torch.device:
    """``cuda:<rank>`` when the call runs on NCCL, else the CPU; use it in rank functions."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
