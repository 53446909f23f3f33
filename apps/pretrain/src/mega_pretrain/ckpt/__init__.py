"""Distributed checkpoints that reshard: save at one parallel layout, load at any other."""

from mega_pretrain.ckpt.describe import (
    CheckpointReport,
    describe_checkpoint,
    inspect_checkpoint,
    resolve_checkpoint,
)
from mega_pretrain.ckpt.load import load_checkpoint
from mega_pretrain.ckpt.meta import CheckpointError, latest_checkpoint
from mega_pretrain.ckpt.save import save_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointReport",
    "describe_checkpoint",
    "inspect_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "resolve_checkpoint",
    "save_checkpoint",
]
