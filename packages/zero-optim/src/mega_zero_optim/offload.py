"""Optimizer CPU offload: the fp32 masters, their gradients and the optimizer state on the host.

Per step, for every owned shard: its reduced gradients are copied device -> host, the
update runs on the CPU (torch's optimizer on host tensors; ``fused=True`` picks its
one-pass multithreaded CPU kernel), and the new values are copied host -> device into the
parameter shard, from which the usual all-gather shares them. On CUDA the host tensors are
pinned and both copies run on a side stream without blocking the host; the shards are
updated one at a time in the order the forward uses them, and each one's upload (and
all-gather) is launched as soon as it is updated, so they overlap the update of the next.
Elsewhere the copies are plain ``copy_`` calls and the arithmetic is the on-device one.
With ``overlap_host_update`` the updates run on a worker thread instead, overlapping the
next forward, which uploads each shard when it first needs it
(:mod:`mega_zero_optim.host_update`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

__all__ = ["HostShard", "Offloader"]


class HostShard:
    """The host side of one owned shard: fp32 master values and gradients, and (for
    parameters of another dtype) a staging copy in the parameter dtype for the upload."""

    def __init__(self, param_shard: torch.Tensor, grad_shard: torch.Tensor, *, pin: bool) -> None:
        n = param_shard.numel()
        self.param_shard = param_shard  # [shard] on the device
        self.grad_shard = grad_shard  # [shard] on the device
        self.master = torch.empty(n, dtype=torch.float32, pin_memory=pin)
        self.master.copy_(param_shard)
        self.grad = torch.zeros(n, dtype=torch.float32, pin_memory=pin)
        self.staging: torch.Tensor | None = None
        if param_shard.dtype != torch.float32:
            self.staging = torch.empty(n, dtype=param_shard.dtype, pin_memory=pin)

    @property
    def nbytes(self) -> int:
        """Host bytes of this shard (masters, gradients, staging)."""
        staging = 0 if self.staging is None else self.staging.numel() * self.staging.element_size()
        return 4 * (self.master.numel() + self.grad.numel()) + staging


class Offloader:
    """The copies between the device and the host shards, on a side stream on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream: Any = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        """Return once every copy in flight has finished (before the host writes a master)."""
        if self.cuda:
            self.stream.synchronize()

    def _on_side(self) -> AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream) if self.cuda else nullcontext()

    def grads_down(self, shards: list[HostShard]) -> None:
        """Copy every shard's reduced gradients to the host; returns when they are there."""
        if self.cuda:  # the reductions (and the last backward) run on the current stream
            self.stream.wait_stream(torch.cuda.current_stream())
        with self._on_side():
            for s in shards:
                s.grad.copy_(s.grad_shard, non_blocking=self.cuda)
        if self.cuda:
            self.stream.synchronize()

    def params_up(self, shard: HostShard) -> None:
        """Copy one shard's updated masters into its device parameter shard (asynchronously
        on CUDA); work queued on the current stream afterwards (the shard's all-gather, the
        next forward) runs after the copy."""
        source = shard.master
        if shard.staging is not None:  # convert on the host: no fp32 copy on the device
            shard.staging.copy_(shard.master)
            source = shard.staging
        with self._on_side():
            shard.param_shard.copy_(source, non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)
