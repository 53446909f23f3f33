"""Process start-up: the device, the default process group (torchrun or one local process)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["pick_device", "start_distributed", "world_size_from_env"]


def world_size_from_env() -> int:
    """The world size torchrun announced, or 1 for a plain ``python -m mega_pretrain``."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("run.device is 'cuda' but no GPU is visible; use --run.device cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_distributed(device: torch.device, timeout: timedelta) -> None:
    """Initialise the default group: from torchrun's variables, or as a world of one."""
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
        return
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
        timeout=timeout,
    )
