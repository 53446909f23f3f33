"""Weights & Biases as a sink of the run's metrics (``run.wandb``); rank 0 only.

``wandb`` is an optional extra, imported only when ``run.wandb`` is on. The W&B run id is
kept in the run folder (``wandb_id``), so that a resumed run logs into the same W&B run.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from mega_pretrain.config import TrainerConfig, config_to_dict

__all__ = ["WANDB_ID_FILE", "WandbSink", "check_wandb"]

#: the file of the run folder that holds the W&B run id
WANDB_ID_FILE = "wandb_id"


def _missing() -> ValueError:
    return ValueError(
        "run.wandb is true but the wandb package is not installed; install the extra with "
        "pip install 'mega-pretrain[wandb]', or set run.wandb false"
    )


def check_wandb(config: TrainerConfig) -> None:
    """Raise one sentence when ``run.wandb`` is on and ``wandb`` cannot be imported (on
    every rank, before anything is built; the package itself is not imported here)."""
    if not config.run.wandb:
        return
    if "wandb" in sys.modules:
        if sys.modules["wandb"] is None:
            raise _missing()
        return
    if importlib.util.find_spec("wandb") is None:
        raise _missing()


def _import_wandb() -> Any:
    try:
        return importlib.import_module("wandb")
    except ImportError:
        raise _missing() from None


class WandbSink:
    """One W&B run for the run folder: ``init`` with the config, ``log``, ``finish``."""

    def __init__(self, run_dir: Path, config: TrainerConfig, layout: dict[str, Any]) -> None:
        wandb = _import_wandb()
        r = config.run
        id_file = run_dir / WANDB_ID_FILE
        resumed = id_file.is_file()
        run_id = id_file.read_text().strip() if resumed else uuid.uuid4().hex[:12]
        if not resumed:  # before init, so that a run killed during it still resumes it
            tmp = id_file.with_name(f".{WANDB_ID_FILE}.tmp")
            tmp.write_text(run_id + "\n")
            os.replace(tmp, id_file)
        settings = json.loads(json.dumps({**config_to_dict(config), "layout": layout}))
        kwargs: dict[str, Any] = {
            "project": r.wandb_project, "entity": r.wandb_entity, "name": r.wandb_name or r.name,
            "dir": str(run_dir), "id": run_id, "resume": "allow",
        }  # fmt: skip
        if r.wandb_mode != "auto":
            kwargs["mode"] = r.wandb_mode
        if not resumed:
            kwargs["config"] = settings
        self.run: Any = wandb.init(**kwargs)
        if resumed:  # this run's settings win (a resume may change train.steps)
            self.run.config.update(settings, allow_val_change=True)

    def log(self, step: int, values: dict[str, float], kind: str) -> None:
        self.run.log({f"{kind}/{key}": value for key, value in values.items()}, step=step)

    def close(self) -> None:
        self.run.finish()
