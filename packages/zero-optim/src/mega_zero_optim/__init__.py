"""Bucketed, overlapped data-parallel gradient reduction and the ZeRO distributed optimizer."""

import importlib.metadata

from mega_zero_optim.accumulate import accumulate_grad
from mega_zero_optim.bucket import BucketState
from mega_zero_optim.clip import ShardMetadata
from mega_zero_optim.ddp import BucketInfo, DistributedDataParallel
from mega_zero_optim.memory import MemoryReport
from mega_zero_optim.optimizer import DistributedOptimizer, StepResult
from mega_zero_optim.scaler import DynamicLossScaler
from mega_zero_optim.shard_range import Piece, Range, owned_pieces

try:
    __version__ = importlib.metadata.version("mega-zero-optim")
except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "BucketInfo",
    "BucketState",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "DynamicLossScaler",
    "MemoryReport",
    "Piece",
    "Range",
    "ShardMetadata",
    "StepResult",
    "__version__",
    "accumulate_grad",
    "owned_pieces",
]
