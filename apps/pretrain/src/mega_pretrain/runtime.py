"""Process start-up: the device, its precision and threads, the default process group
(torchrun or one local process)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from mega_pretrain.config import TrainerConfig
from mega_pretrain.fa4 import activate_fa4

__all__ = [
    "collective_timeout",
    "configure_attention_kernel",
    "configure_tf32",
    "intra_op_threads",
    "pick_device",
    "precision_phrase",
    "resolve_precision",
    "sdpa_backend",
    "set_intra_op_threads",
    "start_distributed",
    "with_precision",
    "world_size_from_env",
]

Precision = Literal["fp32", "bf16", "fp16"]


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


def start_distributed(device: torch.device, timeout: timedelta) -> bool:
    """Initialise the default group: from torchrun's variables, or as a world of one; returns
    whether it was started here (False: the caller's group is used)."""
    if dist.is_initialized():
        return False
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
        return True
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
        timeout=timeout,
    )
    return True


def resolve_precision(
    choice: str, device_type: str | None = None, bf16_supported: bool | None = None
) -> Precision:
    """``train.precision`` made concrete: ``auto`` is bf16 on a CUDA device that supports it,
    fp32 elsewhere (CPU, or a GPU without bf16); any other choice is kept.

    ``device_type`` defaults to ``cuda`` when a GPU is visible; ``bf16_supported`` to what
    ``torch.cuda.is_bf16_supported()`` says (both injectable, so this is tested without a GPU).
    """
    if choice in ("fp32", "bf16", "fp16"):
        return choice  # type: ignore[return-value]
    if choice != "auto":
        raise ValueError(
            f"train.precision ({choice!r}) must be one of 'auto', 'fp32', 'bf16', 'fp16'"
        )
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type != "cuda":
        return "fp32"
    if bf16_supported is None:
        bf16_supported = bool(torch.cuda.is_bf16_supported())
    return "bf16" if bf16_supported else "fp32"


def with_precision(
    config: TrainerConfig, device_type: str | None = None, bf16_supported: bool | None = None
) -> TrainerConfig:
    """``config`` with ``train.precision`` resolved by :func:`resolve_precision`."""
    precision = resolve_precision(config.train.precision, device_type, bf16_supported)
    if precision == config.train.precision:
        return config
    return replace(config, train=replace(config.train, precision=precision))


def precision_phrase(config: TrainerConfig, device_type: str) -> str:
    """How the start-up line and the dry run name the (resolved) precision, e.g.
    ``bf16`` or ``fp32 + tf32 matmuls``."""
    precision = resolve_precision(config.train.precision, device_type)
    if precision == "fp32" and device_type == "cuda":
        return "fp32 + tf32 matmuls" if config.train.tf32 else "fp32 (tf32 off)"
    return precision


def configure_tf32(device: torch.device, enabled: bool) -> bool:
    """On CUDA, let fp32 matmuls and convolutions use TF32 tensor cores (``enabled``) or not;
    returns whether TF32 is on. A no-op on CPU, where there is no TF32."""
    if device.type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    return enabled


#: train.attention_kernel -> the SDPA backend tried first (torch's own order after it)
_SDPA_FIRST = {
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "fa4": "FLASH_ATTENTION",  # that backend, with FlashAttention-4 activated behind it
}


def sdpa_backend(kernel: str) -> torch.nn.attention.SDPBackend:
    """The SDPA backend a ``train.attention_kernel`` other than ``auto`` names."""
    from torch.nn.attention import SDPBackend

    if kernel not in _SDPA_FIRST:
        raise ValueError(
            f"train.attention_kernel ({kernel!r}) is not one of auto, {', '.join(_SDPA_FIRST)}; "
            "pick one of those"
        )
    backend: SDPBackend = getattr(SDPBackend, _SDPA_FIRST[kernel])
    return backend


def configure_attention_kernel(device: torch.device, kernel: str) -> str:
    """On CUDA, put ``kernel``'s SDPA backend first in torch's priority order (``auto``:
    torch's own order); the others stay enabled after it, for the shapes and masks it
    cannot take. ``fa4`` first activates FlashAttention-4 behind the FlashAttention backend
    (:func:`mega_pretrain.fa4.activate_fa4`; one sentence where it cannot run). Set before
    the first forward, so that ``torch.compile`` traces the same choice. Returns the kernel
    in use: ``kernel`` on CUDA, ``"auto"`` on CPU (one kernel)."""
    if kernel == "auto":
        return "auto"
    first = sdpa_backend(kernel).value  # a bad name is one sentence on any device
    if device.type != "cuda":
        return "auto"
    if kernel == "fa4":
        activate_fa4(device)
    order = [first, *(b for b in torch._C._get_sdp_priority_order() if b != first)]
    torch._C._set_sdp_priority_order(order)
    return kernel


def intra_op_threads(
    env: Mapping[str, str] | None = None, cores: int | None = None
) -> tuple[int, str]:
    """Intra-op threads for this process and why: an explicit ``OMP_NUM_THREADS`` wins, else
    the cores this process may run on shared by the ranks of this node (torchrun's
    ``LOCAL_WORLD_SIZE``; without it ``WORLD_SIZE``, which is never fewer), at least 1, so
    that ranks do not oversubscribe the cores."""
    env = os.environ if env is None else env
    explicit = env.get("OMP_NUM_THREADS", "").strip()
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit), "OMP_NUM_THREADS"
    if cores is None:
        cores = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1
        )
    ranks = env.get("LOCAL_WORLD_SIZE") or env.get("WORLD_SIZE") or "1"
    local = max(1, int(ranks) if ranks.isdigit() else 1)
    return max(1, cores // local), f"{cores} cores / {local} local rank(s)"


def set_intra_op_threads() -> str:
    """Apply :func:`intra_op_threads`; returns the phrase the start-up line shows."""
    threads, why = intra_op_threads()
    torch.set_num_threads(threads)
    return f"{threads} thread{'s' if threads != 1 else ''} ({why})"


def collective_timeout(minutes: float) -> timedelta:
    """The timeout of every process group and collective (``run.timeout_minutes``)."""
    return timedelta(minutes=minutes)
