"""Loss and throughput curves of one or several runs, from their metrics.jsonl, to a PNG."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

__all__ = ["plot_runs"]


def _read(run: Path) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run} has no metrics.jsonl; pass a run folder written by mega-pretrain")
    train: list[dict[str, float]] = []
    valid: list[dict[str, float]] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"line {number} of {path} is not valid JSON") from None
        (valid if record.get("kind") == "valid" else train).append(record)
    return train, valid


def plot_runs(runs: Sequence[str | Path], output: str | Path) -> Path:
    """Draw train/valid loss and tokens/s against step for each run; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
    for run in map(Path, runs):
        train, valid = _read(run)
        ax_loss.plot(
            [r["step"] for r in train], [r["loss"] for r in train], label=f"{run.name} train"
        )
        if valid:
            ax_loss.plot(
                [r["step"] for r in valid],
                [r["loss"] for r in valid],
                "o--",
                label=f"{run.name} valid",
            )
        ax_speed.plot(
            [r["step"] for r in train], [r.get("tokens_per_s", 0.0) for r in train], label=run.name
        )
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_speed.set(xlabel="step", ylabel="tokens/s", title="throughput")
    for ax in (ax_loss, ax_speed):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out = Path(output)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
