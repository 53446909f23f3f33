"""Which layers a pipeline stage (pp rank, virtual chunk) owns. Pure arithmetic."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["StageSpec", "stage_spec"]


@dataclass(frozen=True)
class StageSpec:
    """The part of the model one (pp rank, virtual chunk) builds."""

    layers: tuple[int, ...]
    """Global indices of the transformer layers of this chunk, in order."""
    first: bool
    """Holds the input embedding (the first virtual stage of the whole pipeline)."""
    last: bool
    """Holds the final norm, output layer and loss (the last virtual stage)."""


def stage_spec(
    num_layers: int,
    pp: int = 1,
    pp_rank: int = 0,
    vpp: int | None = None,
    chunk: int = 0,
    split: Sequence[int] | None = None,
) -> StageSpec:
    """Layers of virtual stage ``chunk * pp + pp_rank`` (Megatron's interleaved assignment).

    With ``split`` (one layer count per virtual stage, ``pp * vpp`` entries) stages may be
    uneven; otherwise ``num_layers`` must divide evenly into ``pp * vpp`` stages.
    """
    v = vpp or 1
    stages = pp * v
    if not 0 <= pp_rank < pp or not 0 <= chunk < v:
        raise ValueError(f"stage (pp_rank {pp_rank}, chunk {chunk}) is outside pp={pp}, vpp={v}")
    if split is not None:
        counts = list(split)
        if len(counts) != stages or sum(counts) != num_layers or min(counts) < 0:
            raise ValueError(
                f"split {counts} must list {stages} non-negative layer counts (pp*vpp = "
                f"{pp}*{v}) that add up to num_layers ({num_layers})"
            )
    else:
        if num_layers % stages:
            raise ValueError(
                f"num_layers ({num_layers}) is not divisible into pp*vpp ({pp}*{v} = {stages}) "
                "stages; change the layer count or the sizes, or give an explicit split"
            )
        counts = [num_layers // stages] * stages
    virtual = chunk * pp + pp_rank
    start = sum(counts[:virtual])
    return StageSpec(
        layers=tuple(range(start, start + counts[virtual])),
        first=virtual == 0,
        last=virtual == stages - 1,
    )
