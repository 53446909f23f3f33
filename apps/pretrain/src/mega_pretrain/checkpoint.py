"""Distributed checkpoints of the trainer (the code lives in :mod:`mega_pretrain.ckpt`)."""

from mega_pretrain.ckpt import (
    CheckpointError,
    describe_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "CheckpointError",
    "describe_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]
