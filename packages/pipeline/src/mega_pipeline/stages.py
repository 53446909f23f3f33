"""Which layers each pipeline stage holds: pure arithmetic on layer counts."""

from __future__ import annotations

from collections.abc import Sequence

from mega_pipeline.plan import virtual_stage

__all__ = ["rank_layer_ranges", "split_layers"]


def _check_sizes(pp: int, vpp: int | None) -> int:
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp ({pp!r}) must be a positive integer")
    if vpp is None:
        return 1
    if not isinstance(vpp, int) or vpp < 1:
        raise ValueError(f"vpp ({vpp!r}) must be a positive integer, or None for no interleaving")
    if vpp > 1 and pp == 1:
        raise ValueError(
            f"vpp ({vpp}) needs pipeline parallelism, but pp is 1; set pp > 1 or leave vpp unset"
        )
    return vpp


def split_layers(
    num_layers: int, pp: int, vpp: int | None = None, split: Sequence[int] | None = None
) -> list[range]:
    """The layers of each of the ``pp * vpp`` virtual stages, in model order.

    Stage ``s`` runs on pp rank ``s % pp`` as its chunk ``s // pp``. Without ``split``
    the layers are shared evenly, which needs ``num_layers`` divisible by ``pp * vpp``;
    ``split`` gives each stage's layer count explicitly (e.g. fewer layers on the stages
    that also hold the embedding or the output layer).

    >>> split_layers(8, pp=2, vpp=2)
    [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    """
    v = _check_sizes(pp, vpp)
    stages = pp * v
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers ({num_layers!r}) must be a positive integer")
    if split is None:
        if num_layers % stages:
            raise ValueError(
                f"num_layers ({num_layers}) does not divide evenly into pp*vpp ({pp}*{v} = "
                f"{stages}) stages; choose a multiple of {stages} or pass split=[...] with "
                "each stage's layer count"
            )
        counts = [num_layers // stages] * stages
    else:
        counts = list(split)
        if len(counts) != stages or any(not isinstance(c, int) or c < 0 for c in counts):
            raise ValueError(
                f"split {counts} must list {stages} non-negative layer counts, one per "
                f"virtual stage (pp*vpp = {pp}*{v})"
            )
        if sum(counts) != num_layers:
            raise ValueError(
                f"split {counts} adds up to {sum(counts)} layers, but num_layers is "
                f"{num_layers}; make the counts add up to {num_layers}"
            )
    ranges = []
    start = 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def rank_layer_ranges(
    num_layers: int,
    pp: int,
    pp_rank: int,
    vpp: int | None = None,
    split: Sequence[int] | None = None,
) -> list[range]:
    """The layers of each chunk of rank ``pp_rank`` (chunk ``c`` is stage ``c * pp + pp_rank``).

    >>> rank_layer_ranges(8, pp=2, pp_rank=1, vpp=2)
    [range(2, 4), range(6, 8)]
    """
    ranges = split_layers(num_layers, pp, vpp, split)
    if not isinstance(pp_rank, int) or not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank ({pp_rank!r}) must be in 0..{pp - 1} for pp={pp}")
    v = 1 if vpp is None else vpp
    return [ranges[virtual_stage(pp, pp_rank, c)] for c in range(v)]
