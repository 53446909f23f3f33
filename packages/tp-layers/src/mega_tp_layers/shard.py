"""Shard metadata: every parameter a mega layer creates says how it is split (DESIGN rule 3).

A parameter carries ``param.mega_shard``, a frozen :class:`ShardSpec`. Checkpoint
resharding, global gradient norms (which skip ``duplicate`` replicas), HF conversion and
the contract tests read it through :func:`shard_spec`. Shards are always equal,
contiguous slices of the full tensor, in rank order, along one dimension.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from mega_tp_layers._comm import all_gather_dim0, group_rank, group_size

__all__ = [
    "SHARD_ATTR",
    "ShardSpec",
    "gather_full",
    "mark_replicated",
    "set_shard_spec",
    "shard_spec",
    "shard_tensor",
    "unshard",
]

#: Name of the parameter attribute that holds the :class:`ShardSpec`.
SHARD_ATTR = "mega_shard"


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter's local tensor relates to the full (unsharded) tensor."""

    dim: int | None
    """Dimension of the full tensor split across the group; None: replicated over it."""
    num_shards: int
    """Size of the group the tensor is split (or replicated) over."""
    shard_rank: int
    """This rank's index in that group; its shard is slice ``shard_rank`` of ``dim``."""
    group: str
    """Name of the group's dimension: ``"tp"`` (``"etp"``/``"ep"`` for experts)."""
    full_shape: tuple[int, ...]
    """Shape of the full tensor (a padded vocabulary counts its padding rows)."""
    duplicate: bool
    """True on a replica that another rank counts (norms and counts skip it)."""

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards ({self.num_shards}) must be a positive integer")
        if not 0 <= self.shard_rank < self.num_shards:
            raise ValueError(
                f"shard_rank ({self.shard_rank}) must lie in [0, {self.num_shards}); "
                "pass this rank's index in its group"
            )
        if self.dim is not None:
            ndim = len(self.full_shape)
            if not 0 <= self.dim < ndim:
                raise ValueError(
                    f"dim ({self.dim}) is not a dimension of full_shape {self.full_shape}; "
                    f"use 0..{ndim - 1}, or None for a replicated tensor"
                )
            if self.full_shape[self.dim] % self.num_shards != 0:
                raise ValueError(
                    f"full_shape[{self.dim}] ({self.full_shape[self.dim]}) is not divisible "
                    f"by num_shards ({self.num_shards}); pad it to a multiple of {self.num_shards}"
                )

    @property
    def is_replicated(self) -> bool:
        """True when every rank of the group holds the whole tensor."""
        return self.dim is None

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of this rank's tensor."""
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] //= self.num_shards
        return tuple(shape)

    @property
    def local_slice(self) -> tuple[slice, ...]:
        """Index of this rank's shard inside the full tensor: ``full[spec.local_slice]``."""
        index = [slice(None)] * len(self.full_shape)
        if self.dim is not None:
            size = self.full_shape[self.dim] // self.num_shards
            index[self.dim] = slice(self.shard_rank * size, (self.shard_rank + 1) * size)
        return tuple(index)

    def with_rank(self, shard_rank: int) -> ShardSpec:
        """The spec another rank of the same group holds."""
        duplicate = self.dim is None and shard_rank != 0
        return ShardSpec(
            self.dim, self.num_shards, shard_rank, self.group, self.full_shape, duplicate
        )


def shard_spec(param: Tensor) -> ShardSpec | None:
    """The :class:`ShardSpec` of ``param``, or None if nothing says how it is sharded."""
    spec = getattr(param, SHARD_ATTR, None)
    return spec if isinstance(spec, ShardSpec) else None


def set_shard_spec(param: Tensor, spec: ShardSpec) -> None:
    """Attach ``spec`` to ``param`` after checking that the local shape matches."""
    if tuple(param.shape) != spec.local_shape:
        raise ValueError(
            f"parameter shape {tuple(param.shape)} does not match the shard {spec.local_shape} "
            f"of full shape {spec.full_shape} split {spec.num_shards} ways on dim {spec.dim}; "
            "fix the spec or the parameter"
        )
    setattr(param, SHARD_ATTR, spec)


def mark_replicated(param: Tensor, tp_group: ProcessGroup, *, group_name: str = "tp") -> ShardSpec:
    """Mark a parameter every rank of ``tp_group`` holds whole (a norm weight, a row bias).

    Rank 0 of the group counts it; the others are duplicates. Note that
    ``Module.to_empty`` creates new parameters: mark them after materialising.
    """
    spec = ShardSpec(
        dim=None,
        num_shards=group_size(tp_group),
        shard_rank=group_rank(tp_group),
        group=group_name,
        full_shape=tuple(param.shape),
        duplicate=group_rank(tp_group) != 0,
    )
    set_shard_spec(param, spec)
    return spec


def _split_args(
    spec: ShardSpec | int | None, rank: int | None, num_shards: int | None
) -> tuple[int | None, int, int]:
    if isinstance(spec, ShardSpec):
        return (
            spec.dim,
            spec.shard_rank if rank is None else rank,
            spec.num_shards if num_shards is None else num_shards,
        )
    if rank is None or num_shards is None:
        raise ValueError(
            f"shard_tensor with dim {spec} needs rank and num_shards; pass both, or a ShardSpec"
        )
    return spec, rank, num_shards


def shard_tensor(
    full: Tensor,
    spec: ShardSpec | int | None,
    rank: int | None = None,
    num_shards: int | None = None,
) -> Tensor:
    """This rank's shard of ``full`` (a new tensor that does not share memory with it).

    ``spec`` is a :class:`ShardSpec` (``rank``/``num_shards`` default to its own) or the
    split dimension (None: replicated, the whole tensor is returned). A full tensor shorter
    along the split dimension than a ShardSpec's ``full_shape`` is zero-padded at the end
    first: that is the padded-vocabulary rule (:func:`mega_tp_layers.padded_vocab_size`).
    """
    dim, rank, num_shards = _split_args(spec, rank, num_shards)
    if dim is None:
        return full.clone()
    dim = dim % full.dim()
    if isinstance(spec, ShardSpec) and full.shape[dim] < spec.full_shape[dim]:
        pad_shape = list(full.shape)
        pad_shape[dim] = spec.full_shape[dim] - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    if isinstance(spec, ShardSpec) and tuple(full.shape) != tuple(spec.full_shape):
        raise ValueError(
            f"the full tensor has shape {tuple(full.shape)} but the shard spec describes "
            f"{tuple(spec.full_shape)}; pass the whole tensor this parameter was sharded from"
        )
    if full.shape[dim] % num_shards != 0:
        raise ValueError(
            f"dimension {dim} of the full tensor ({full.shape[dim]}) is not divisible by "
            f"num_shards ({num_shards}); pad it to a multiple of {num_shards}"
        )
    if not 0 <= rank < num_shards:
        raise ValueError(f"rank ({rank}) must lie in [0, {num_shards}) for {num_shards} shards")
    return full.chunk(num_shards, dim=dim)[rank].clone()


def unshard(shards: Sequence[Tensor], spec: ShardSpec | int | None) -> Tensor:
    """Rebuild the full tensor from every rank's shard, in rank order (no communication)."""
    dim = spec.dim if isinstance(spec, ShardSpec) else spec
    if dim is None:
        return shards[0].clone()
    return torch.cat(list(shards), dim=dim)


def gather_full(local: Tensor, spec: ShardSpec, group: ProcessGroup) -> Tensor:
    """All-gather ``local`` over ``group`` into the full tensor (collective: every rank calls)."""
    if spec.dim is None or group_size(group) == 1:
        return local.detach().clone()
    if group_size(group) != spec.num_shards:
        raise ValueError(
            f"group has {dist.get_world_size(group)} ranks but the spec splits "
            f"{spec.num_shards} ways; pass the group the tensor is sharded over"
        )
    stacked, _ = all_gather_dim0(local.detach().unsqueeze(0), group)  # [n, *local]
    return torch.cat(stacked.unbind(0), dim=spec.dim)
