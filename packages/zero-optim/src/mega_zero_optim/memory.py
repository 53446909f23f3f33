"""How many bytes per parameter the data-parallel wrapper and the optimizer hold on this rank."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MemoryReport"]


@dataclass(frozen=True)
class MemoryReport:
    """Bytes this rank allocated for its trainable parameters, by kind.

    Counted from the storages allocated when asked. With bf16 parameters, fp32 gradients
    and Adam, ``bytes_per_param`` is about 2 + 4 + 12/dp for ``sharding="optimizer"``
    (ZeRO-1: the parameter and gradient buffers are whole on every rank, the fp32 master
    weights and both moments only for the rank's shard), 2 + 16/dp for ``"gradients"``
    (ZeRO-2: only the gradient shards persist; during backward a few buckets' full
    gradients come and go) and 18/dp for ``"parameters"`` (ZeRO-3, between uses: the
    gathered buckets are freed). fp32 parameters need no separate master copy
    (4 + 4 + 8/dp for ZeRO-1). bf16 Adam moments (``moment_dtype``) halve the moments' 8
    bytes (2 + 4 + 8/dp for bf16 ZeRO-1). Padding to whole dp shards counts as allocated.
    """

    num_params: int
    """Trainable parameter elements on this rank (padding excluded)."""
    param_bytes: int
    """The parameter buffers (padding included)."""
    grad_bytes: int
    """The gradient buffers (padding included)."""
    master_bytes: int
    """fp32 master copies of this rank's shards (0 when the parameters are fp32 already)."""
    state_bytes: int
    """Optimizer state tensors (Adam moments, SGD momentum, step counters)."""
    host_bytes: int = 0
    """``optimizer_offload``: host memory of the masters, their gradients, the upload staging
    and the optimizer state (then 0 in ``master_bytes`` and ``state_bytes``); not in
    :attr:`total_bytes`, which counts what the device holds."""

    @property
    def total_bytes(self) -> int:
        """Everything above, summed."""
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.state_bytes

    @property
    def bytes_per_param(self) -> float:
        """``total_bytes / num_params``."""
        return self.total_bytes / max(self.num_params, 1)

    def __str__(self) -> str:
        n = max(self.num_params, 1)
        parts = [
            f"param {self.param_bytes / n:.2f}",
            f"grad {self.grad_bytes / n:.2f}",
            f"master {self.master_bytes / n:.2f}",
            f"state {self.state_bytes / n:.2f}",
        ]
        per = f"{self.bytes_per_param:.2f} bytes/param"
        host = f"; host {self.host_bytes / n:.2f}" if self.host_bytes else ""
        return f"{per} ({', '.join(parts)}{host}) over {self.num_params:,} params"
