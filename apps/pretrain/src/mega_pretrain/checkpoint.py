"""Distributed checkpoints of the trainer (the code lives in :mod:`mega_pretrain.ckpt`)."""

from mega_pretrain.ckpt import (
    CheckpointError,
    CheckpointReport,
    describe_checkpoint,
    inspect_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)

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
