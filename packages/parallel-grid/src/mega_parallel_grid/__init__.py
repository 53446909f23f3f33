"""Rank layouts and process groups for tensor, pipeline, data, context and expert parallelism."""

from mega_parallel_grid.config import DIMENSION_NAMES, ParallelConfig
from mega_parallel_grid.groups import (
    DEFAULT_TIMEOUT,
    GROUP_DIMS,
    ProcessGroups,
    init_process_groups,
)
from mega_parallel_grid.layout import DENSE_DIMS, EXPERT_DIMS, RankLayout

__all__ = [
    "DEFAULT_TIMEOUT",
    "DENSE_DIMS",
    "DIMENSION_NAMES",
    "EXPERT_DIMS",
    "GROUP_DIMS",
    "ParallelConfig",
    "ProcessGroups",
    "RankLayout",
    "init_process_groups",
]
