"""Process groups of one rank each: for the single-process reference inside a parallel test."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import ProcessGroup

from mega_parallel_grid.config import ParallelConfig
from mega_parallel_grid.groups import GROUP_DIMS, ProcessGroups
from mega_parallel_grid.layout import RankLayout

__all__ = ["solo_groups"]


def solo_groups() -> ProcessGroups:
    """Every dimension a group of this rank alone, so a model built with them is unsplit.

    Collective: every rank of the default group must call it (each creates the one-rank
    groups of all ranks, in the same order).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    mine: ProcessGroup | None = None
    for r in range(world):
        group = dist.new_group([r])
        if r == rank:
            assert isinstance(group, ProcessGroup)
            mine = group
    assert mine is not None
    fields = {name: mine for name in GROUP_DIMS}
    return ProcessGroups(
        **fields, embedding=mine, world=mine, layout=RankLayout(1, ParallelConfig()), global_rank=0
    )
