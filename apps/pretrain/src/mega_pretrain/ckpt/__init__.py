"""Distributed checkpoints that reshard: save at one parallel layout, load at any other."""

from mega_pretrain.ckpt.load import load_checkpoint
from mega_pretrain.ckpt.meta import CheckpointError, describe_checkpoint, latest_checkpoint
from mega_pretrain.ckpt.save import save_checkpoint

__all__ = [
    "CheckpointError",
    "describe_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]
