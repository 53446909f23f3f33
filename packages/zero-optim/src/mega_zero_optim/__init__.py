"""Bucketed, overlapped data-parallel gradient reduction and the ZeRO distributed optimizer."""

from mega_zero_optim.bucket import BucketState
from mega_zero_optim.clip import ShardMetadata, counts_in_norm
from mega_zero_optim.ddp import BucketInfo, DistributedDataParallel
from mega_zero_optim.memory import MemoryReport
from mega_zero_optim.optimizer import DistributedOptimizer, StepResult
from mega_zero_optim.scaler import DynamicLossScaler
from mega_zero_optim.shard_range import Piece, Range, bucket_ranges, owned_pieces, pack, shard_of

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
    "bucket_ranges",
    "counts_in_norm",
    "owned_pieces",
    "pack",
    "shard_of",
]
