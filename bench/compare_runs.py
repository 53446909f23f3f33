"""Loss curves of trainer runs side by side: the largest step-by-step difference to the first.

    python3 bench/compare_runs.py runs/a runs/b [runs/c ...]

Reads each run folder's ``metrics.jsonl`` (the trainer's log), pairs the training records
by step, and prints per run: steps compared, max |loss - loss_first_run|, the same relative,
the largest relative difference of the moving averages over ``--window`` logged records
(one batch's loss is noisy; log every step for this), the relative difference of the mean
over the last window, the mean tokens/s over the records after the first (compile and
warm-up excluded) and, for MoE runs, the last logged router imbalance (max/mean tokens per
expert).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def records(run: Path) -> list[dict[str, Any]]:
    with open(run / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r.get("kind") == "train" and "loss" in r]


def moving(values: list[float], window: int) -> list[float]:
    """Means over every ``window`` consecutive values (all of them when fewer)."""
    w = max(1, min(window, len(values)))
    return [statistics.mean(values[i : i + w]) for i in range(len(values) - w + 1)]


def main(argv: list[str]) -> None:
    window = 20
    if len(argv) >= 2 and argv[0] == "--window":
        window, argv = int(argv[1]), argv[2:]
    runs = argv
    if len(runs) < 1:
        raise SystemExit("usage: compare_runs.py [--window N] RUN_DIR [RUN_DIR ...]")
    base = {r["step"]: r["loss"] for r in records(Path(runs[0]))}
    print(
        f"{'run':<40}{'steps':>6}{'max |dloss|':>13}{'rel':>9}{f'avg{window} rel':>11}"
        f"{'last rel':>10}{'tokens/s':>12}{'imbalance':>11}"
    )
    for run in runs:
        rows = records(Path(run))
        shared = [r for r in rows if r["step"] in base]
        diffs = [abs(r["loss"] - base[r["step"]]) for r in shared]
        rel = [d / abs(base[r["step"]]) for d, r in zip(diffs, shared, strict=True)]
        mine = moving([r["loss"] for r in shared], window)
        theirs = moving([base[r["step"]] for r in shared], window)
        smooth = [abs(x - y) / abs(y) for x, y in zip(mine, theirs, strict=True)]
        last = abs(mine[-1] - theirs[-1]) / abs(theirs[-1]) if mine else 0.0
        speed = [r["tokens_per_s"] for r in rows[1:]] or [r["tokens_per_s"] for r in rows]
        imbalance = rows[-1].get("moe_imbalance") if rows else None
        print(
            f"{run[-40:]:<40}{len(shared):>6}{max(diffs, default=0.0):>13.4g}"
            f"{max(rel, default=0.0):>9.2%}{max(smooth, default=0.0):>11.2%}{last:>10.2%}"
            f"{statistics.mean(speed):>12,.0f}"
            f"{'' if imbalance is None else f'{imbalance:.2f}':>11}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
