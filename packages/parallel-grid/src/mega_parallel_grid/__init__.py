"""Rank layouts and process groups for tensor, pipeline, data, context and expert parallelism."""

import importlib.metadata

from mega_parallel_grid.config import DIMENSION_NAMES, ParallelConfig
from mega_parallel_grid.groups import (
    DEFAULT_TIMEOUT,
    GROUP_DIMS,
    Group,
    ProcessGroups,
    group_rank,
    group_size,
    init_process_groups,
)
from mega_parallel_grid.layout import (
    DENSE_DIMS,
    EXPERT_DIMS,
    EXPERT_HSDP_DIMS,
    HSDP_DIMS,
    RankLayout,
)

try:
    __version__ = importlib.metadata.version("mega-parallel-grid")
except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "DEFAULT_TIMEOUT",
    "DENSE_DIMS",
    "DIMENSION_NAMES",
    "EXPERT_DIMS",
    "EXPERT_HSDP_DIMS",
    "GROUP_DIMS",
    "HSDP_DIMS",
    "Group",
    "ParallelConfig",
    "ProcessGroups",
    "RankLayout",
    "__version__",
    "group_rank",
    "group_size",
    "init_process_groups",
]
