"""Which layers a pipeline stage (pp rank, virtual chunk) owns. Pure arithmetic."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["StageSpec", "stage_layer_counts", "stage_spec"]


@dataclass(frozen=True)
class StageSpec:
    """The part of the model one (pp rank, virtual chunk) builds."""

    layers: tuple[int, ...]
    """Global indices of the transformer layers of this chunk, in order."""
    first: bool
    """Holds the input embedding (the first virtual stage of the whole pipeline)."""
    last: bool
    """Holds the final norm, output layer and loss (the last virtual stage)."""


def stage_layer_counts(
    num_layers: int,
    pp: int = 1,
    vpp: int | None = None,
    split: Sequence[int] | None = None,
    split_name: str = "split",
) -> tuple[int, ...]:
    """Layers of each virtual stage, in pipeline order (``pp * vpp`` counts).

    With ``split`` (one positive count per virtual stage) stages may be uneven; otherwise
    ``num_layers`` must divide evenly into ``pp * vpp`` stages. ``split_name`` is what the
    caller calls the split in its error sentence (the trainer's ``parallel.pp_layers``).
    """
    v = vpp or 1
    stages = pp * v
    if split:
        counts = tuple(split)
        if len(counts) != stages or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"{split_name} {list(counts)} must give {stages} positive layer counts, one per "
                f"virtual stage (pp*vpp = {pp}*{v}), adding up to num_layers ({num_layers})"
            )
        return counts
    if num_layers % stages:
        raise ValueError(
            f"num_layers ({num_layers}) is not divisible into pp*vpp ({pp}*{v} = {stages}) "
            f"stages; change the layer count or the sizes, or give an explicit {split_name}"
        )
    return (num_layers // stages,) * stages


def stage_spec(
    num_layers: int,
    pp: int = 1,
    pp_rank: int = 0,
    vpp: int | None = None,
    chunk: int = 0,
    split: Sequence[int] | None = None,
) -> StageSpec:
    """Layers of virtual stage ``chunk * pp + pp_rank`` (Megatron's interleaved assignment).

    The split is :func:`stage_layer_counts`'s (even, or the explicit ``split``).
    """
    v = vpp or 1
    if not 0 <= pp_rank < pp or not 0 <= chunk < v:
        raise ValueError(f"stage (pp_rank {pp_rank}, chunk {chunk}) is outside pp={pp}, vpp={v}")
    counts = stage_layer_counts(num_layers, pp, vpp, split)
    virtual = chunk * pp + pp_rank
    start = sum(counts[:virtual])
    return StageSpec(
        layers=tuple(range(start, start + counts[virtual])),
        first=virtual == 0,
        last=virtual == len(counts) - 1,
    )
