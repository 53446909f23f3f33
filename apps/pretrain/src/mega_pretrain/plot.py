"""Curves of one or several runs from their metrics.jsonl, to a PNG (``mega-pretrain plot``).

One panel per logged quantity, side by side: loss (train, and valid as dashed markers), then
the learning rate, the gradient norm and the throughput when the logs hold them. Each run
keeps one colour in every panel (the legend is on the loss panel), and the step axis has
integer ticks only.

``mega-pretrain plot runs/a runs/b --output curves.png``
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PANELS", "Panel", "RunCurves", "choose_panels", "plot_figure", "plot_runs", "read_runs",
    "run_colours",
]  # fmt: skip


@dataclass(frozen=True)
class Panel:
    """One subplot: the record key it draws and how it is labelled."""

    key: str
    title: str
    ylabel: str


#: the panels, in the order they are drawn; one is drawn when some train record has its key
PANELS = (
    Panel("loss", "loss", "loss"),
    Panel("lr", "learning rate", "lr"),
    Panel("grad_norm", "gradient norm", "grad norm"),
    Panel("tokens_per_s", "throughput", "tokens/s"),
)


@dataclass(frozen=True)
class RunCurves:
    """One run's records: its label (the folder name, or more of the path where two runs
    share a name), train and valid records."""

    label: str
    train: list[dict[str, Any]]
    valid: list[dict[str, Any]]


def _read(run: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run} has no metrics.jsonl; pass a run folder written by mega-pretrain")
    train: list[dict[str, Any]] = []
    valid: list[dict[str, Any]] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"line {number} of {path} is not valid JSON") from None
        (valid if record.get("kind") == "valid" else train).append(record)
    return train, valid


def _labels(runs: Sequence[Path]) -> list[str]:
    """The folder names, with as many parent folders as it takes to tell them apart."""
    resolved = [run.resolve() for run in runs]
    depth = 1
    while True:
        labels = ["/".join(run.parts[-depth:]) for run in resolved]
        if len(set(labels)) == len(labels) or depth >= max(len(r.parts) for r in resolved):
            return labels
        depth += 1


def read_runs(runs: Sequence[str | Path]) -> list[RunCurves]:
    """Each run folder's records, labelled."""
    paths = [Path(run) for run in runs]
    return [
        RunCurves(label, *_read(path)) for label, path in zip(_labels(paths), paths, strict=True)
    ]


def run_colours(labels: Sequence[str]) -> dict[str, str]:
    """One colour per run (matplotlib's cycle ``C0``, ``C1``, ... in the order given), the
    same in every panel."""
    return {label: f"C{i % 10}" for i, label in enumerate(labels)}


def choose_panels(runs: Sequence[RunCurves]) -> list[Panel]:
    """The panels some run's train records have numbers for; loss first."""
    keys = {k for run in runs for record in run.train for k, v in record.items() if _number(v)}
    return [panel for panel in PANELS if panel.key in keys]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _points(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    chosen = [r for r in records if _number(r.get(key)) and _number(r.get("step"))]
    return [int(r["step"]) for r in chosen], [float(r[key]) for r in chosen]


def plot_figure(runs: Sequence[str | Path]) -> Any:
    """The matplotlib Figure of ``runs`` (Agg backend), one panel per :func:`choose_panels`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    curves = read_runs(runs)
    panels = choose_panels(curves)
    if not panels:
        raise ValueError(
            f"the metrics.jsonl of {', '.join(map(str, runs))} hold no train records with a "
            "loss, lr, grad_norm or tokens_per_s; pass run folders that logged at least one step"
        )
    colours = run_colours([c.label for c in curves])
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for run in curves:
            colour = colours[run.label]
            steps, values = _points(run.train, panel.key)
            if steps:
                ax.plot(steps, values, color=colour, label=f"{run.label} train")
            if panel.key == "loss":
                steps, values = _points(run.valid, "loss")
                if steps:
                    ax.plot(steps, values, "o--", color=colour, label=f"{run.label} valid")
        ax.set(xlabel="step", ylabel=panel.ylabel, title=panel.title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    return fig


def plot_runs(runs: Sequence[str | Path], output: str | Path) -> Path:
    """Draw the curves of ``runs`` (see the module docstring) into ``output``; returns it."""
    fig = plot_figure(runs)
    import matplotlib.pyplot as plt

    out = Path(output)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
