"""The process group a benchmark script runs in: torchrun's, or a world of one without it."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

__all__ = ["init_world"]


def init_world(smoke: bool) -> torch.device:
    """Join torchrun's world (a world of one on a free local port under plain ``python3``):
    gloo on one CPU thread for ``--smoke``, else NCCL on this rank's GPU (no GPU: exit with
    the way out)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if smoke:
        dist.init_process_group("gloo")
        torch.set_num_threads(1)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no GPU visible; run with --smoke to check the script on a CPU")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    return torch.device("cuda", torch.cuda.current_device())
