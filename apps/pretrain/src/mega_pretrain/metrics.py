"""Run metrics: a JSONL file, TensorBoard events and optionally W&B, on rank 0 only."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from mega_pretrain.config import TrainerConfig, config_to_dict
from mega_pretrain.wandb_sink import WandbSink, check_wandb

__all__ = ["MetricsLogger", "peak_tflops"]

# Dense bf16 tensor-core peaks (datasheet, TFLOP/s) by device-name fragment.
_PEAKS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0,
          "L40S": 362.0, "B200": 2250.0, "GB200": 2500.0}  # fmt: skip


def peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """Peak bf16 TFLOP/s of one device for MFU: the override, a known GPU's, else None."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peak in _PEAKS.items():
        if fragment in name:
            return peak
    return None


class MetricsLogger:
    """Writes ``metrics.jsonl``, TensorBoard events and (``run.wandb``) W&B under the run folder.

    Only the process created with ``enabled=True`` (rank 0) writes anything. Given the
    run's ``config`` (and ``layout``: world size, dp...), the config is recorded once, as
    TensorBoard text and as the W&B run's config.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        tensorboard: bool,
        config: TrainerConfig | None = None,
        layout: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self._file = None
        self._tb: Any = None
        self._wandb: WandbSink | None = None
        if config is not None:
            check_wandb(config)  # every rank says it alike
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = (run_dir / "metrics.jsonl").open("a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # the GPU image may lack tensorboard: JSONL still works
                self._tb = None
            else:
                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if config is None:
            return
        settings = {**config_to_dict(config), "layout": layout or {}}
        if self._tb is not None:
            text = json.dumps(settings, indent=2)
            self._tb.add_text("config", "    " + text.replace("\n", "\n    "))  # markdown code
        if config.run.wandb:
            self._wandb = WandbSink(run_dir, config, layout or {})

    def log(self, step: int, values: dict[str, float], kind: str = "train") -> None:
        """Append one record; numbers go to TensorBoard as ``kind/name``."""
        if not self.enabled or self._file is None:
            return
        record = {"step": step, "kind": kind, "time": time.time(), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(f"{kind}/{key}", value, step)
        if self._wandb is not None:
            self._wandb.log(step, values, kind)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
