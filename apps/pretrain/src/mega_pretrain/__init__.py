"""mega-pretrain: the trainer that composes the mega packages into a pre-training run.

Config file + ``--section.field`` overrides, data pipeline, training loop, logging,
resharding checkpoints, resume and evaluation. From the command line::

    uv run mega-pretrain                                   # tiny GPT on CPU, no arguments
    torchrun --nproc-per-node 8 -m mega_pretrain --config configs/8b.toml --tp 2 --pp 2

From Python, ``main`` is the command (it returns the exit status) and ``load_config``
reads a config the same way, file then dotted overrides::

    from mega_pretrain import load_config, main

    config = load_config("configs/tiny.toml", [("train.steps", "20")])  # a TrainerConfig
    status = main(["--config", "configs/tiny.toml", "--train.steps", "20"])

``save_checkpoint`` / ``load_checkpoint`` write and read what one rank trains (a ``Built``)
at any parallel layout; a failure is a ``CheckpointError``, a failed run a ``TrainingError``.

The names load on first use (PEP 562 ``__getattr__``): the training loop and the
checkpoints import torch.distributed, the models and the data libraries, which
``import mega_pretrain`` and ``mega-pretrain --help`` do not need.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mega_pretrain.build import Built
    from mega_pretrain.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from mega_pretrain.cli import main
    from mega_pretrain.config import TrainerConfig, load_config
    from mega_pretrain.errors import TrainingError

try:
    __version__ = importlib.metadata.version("mega-pretrain")
except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "Built",
    "CheckpointError",
    "TrainerConfig",
    "TrainingError",
    "__version__",
    "load_checkpoint",
    "load_config",
    "main",
    "save_checkpoint",
]

_HOME = {
    "Built": "build",
    "CheckpointError": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "main": "cli",
    "TrainerConfig": "config",
    "load_config": "config",
    "TrainingError": "errors",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'mega_pretrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"mega_pretrain.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
