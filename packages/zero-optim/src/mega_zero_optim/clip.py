"""Global gradient norm over every rank holding distinct gradient pieces, and clipping by it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "ShardMetadata",
    "clip_coefficient",
    "counts_in_norm",
    "global_grad_norm",
    "raise_nonfinite",
]


@runtime_checkable
class ShardMetadata(Protocol):
    """What this package reads of a parameter's ``mega_shard`` attribute.

    mega-tp-layers attaches a ``ShardSpec`` there; this package does not import it and
    only needs to know whether this rank's copy is a replica that another rank counts.
    """

    @property
    def duplicate(self) -> bool:
        """True when another rank holds the same values and counts them."""


def counts_in_norm(param: torch.Tensor) -> bool:
    """False for a parameter whose ``mega_shard.duplicate`` is True; True otherwise."""
    spec = getattr(param, "mega_shard", None)
    if spec is None:
        return True
    if not isinstance(spec, ShardMetadata):
        raise TypeError(
            f"the parameter's mega_shard attribute ({type(spec).__name__}) has no 'duplicate' "
            "field; attach a mega_tp_layers ShardSpec or remove the attribute"
        )
    return not spec.duplicate


def global_grad_norm(
    grads: Sequence[torch.Tensor],
    group: ProcessGroup | None,
    device: torch.device,
    *,
    scaled: Sequence[torch.Tensor] = (),
    unscale: float = 1.0,
) -> torch.Tensor:
    """The 2-norm of the gradients that all ranks of ``group`` (None: the world) hold, as fp32.

    Each rank passes the pieces it alone counts (its dp shard, without tp replicas), so
    the sum of squares over the group counts every element once. ``scaled``: gradients
    still multiplied by a loss scale (the bf16/fp16 shards the flat step unscales as it
    reads them), counted times ``unscale``. Every norm is accumulated in fp32 whatever the
    gradients' dtype. Non-finite gradients give a non-finite norm on every rank.
    """
    parts = [_norm32(grads)] if grads else []
    if scaled:
        parts.append(_norm32(scaled) * unscale)
    local: torch.Tensor
    if parts:  # host pieces (offload) reduce on the device
        local = torch.linalg.vector_norm(torch.stack([p.to(device) for p in parts]))
    else:
        local = torch.zeros((), dtype=torch.float32, device=device)
    squared = local * local
    if dist.get_world_size(group) > 1:
        dist.all_reduce(squared, group=group)
    return squared.sqrt()


def _norm32(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``grads`` accumulated and returned in fp32, on the first one's device
    (one multi-tensor pass per device and dtype; bf16 inputs are not copied)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    first = grads[0].device
    norms = [
        n.to(first)
        for ts in groups.values()
        for n in torch._foreach_norm(ts, 2.0, dtype=torch.float32)
    ]
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms))
    return total


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor ``torch.nn.utils.clip_grad_norm_`` would scale gradients by (at most 1)."""
    return min(max_norm / (total_norm + 1e-6), 1.0)


def raise_nonfinite(
    grads: Sequence[tuple[str, torch.Tensor | None]],
    norm: float,
    step: int,
    group: ProcessGroup | None,
) -> NoReturn:
    """Raise FloatingPointError naming the first of ``grads`` (name, gradient) holding nan
    or inf, agreed on by every rank of ``group`` (collective over it)."""
    bad = next((n for n, g in grads if g is not None and not g.isfinite().all()), None)
    world = dist.get_world_size(group)
    found: list[str | None] = [bad]
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, bad, group=group)
    where = [(r, n) for r, n in enumerate(found) if n is not None]
    if not where:
        raise FloatingPointError(
            f"step {step}: the global gradient norm is {norm} although no gradient "
            "element is non-finite (the sum of squares overflowed); lower the loss scale or "
            "the learning rate"
        )
    rank, name = where[0]
    others = f" and on {len(where) - 1} other ranks" if len(where) > 1 else ""
    raise FloatingPointError(
        f"step {step}: the gradient of {name!r} holds nan or inf (found on rank "
        f"{rank} of the gradient-norm group{others}); check the data and the learning rate, "
        "or train fp16 with a DynamicLossScaler"
    )
