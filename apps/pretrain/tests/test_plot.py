"""``mega-pretrain plot``: integer step ticks, one colour per run in every panel, lr and
grad-norm panels beside the loss when the logs hold them (matplotlib's Agg backend)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mega_pretrain.plot import choose_panels, plot_figure, plot_runs, read_runs, run_colours


def _run(folder: Path, records: list[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True)
    lines = [json.dumps({"kind": "train", "time": 0.0, **r}) for r in records]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _full(step: int) -> dict[str, Any]:
    return {"step": step, "loss": 5.0 - 0.1 * step, "lr": 1e-4 * step, "grad_norm": 1.0 / step,
            "tokens_per_s": 1000.0 + step}  # fmt: skip


def test_panels_follow_the_logged_keys(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", [_full(s) for s in (1, 2, 3)])
    b = _run(tmp_path / "b", [{"step": 1, "loss": 5.0}])
    assert [p.key for p in choose_panels(read_runs([a]))] == [
        "loss", "lr", "grad_norm", "tokens_per_s",
    ]  # fmt: skip
    assert [p.key for p in choose_panels(read_runs([b]))] == ["loss"]
    assert [p.key for p in choose_panels(read_runs([b, a]))][:3] == ["loss", "lr", "grad_norm"]


def test_colours_are_one_per_run_and_labels_tell_equal_names_apart(tmp_path: Path) -> None:
    one = _run(tmp_path / "x/tiny", [_full(1)])
    two = _run(tmp_path / "y/tiny", [_full(1)])
    labels = [run.label for run in read_runs([one, two])]
    assert labels == ["x/tiny", "y/tiny"]
    assert run_colours(labels) == {"x/tiny": "C0", "y/tiny": "C1"}
    assert run_colours(labels) == run_colours(list(labels))  # stable


def test_the_figure_has_integer_step_ticks_and_a_colour_per_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    a = _run(tmp_path / "a", [_full(s) for s in (1, 2, 3)])  # 3 steps: fractional ticks by default
    b = _run(tmp_path / "b", [_full(s) for s in (1, 2)])
    with (a / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "kind": "valid", "loss": 4.9}) + "\n")
    fig = plot_figure([a, b])
    fig.canvas.draw()
    assert [ax.get_title() for ax in fig.axes] == [
        "loss", "learning rate", "gradient norm", "throughput",
    ]  # fmt: skip
    for ax in fig.axes:
        ticks = ax.get_xticks()
        assert len(ticks) > 1 and all(float(t).is_integer() for t in ticks), ticks
        colours = {line.get_label().split()[0]: line.get_color() for line in ax.get_lines()}
        assert colours == {"a": "C0", "b": "C1"}, colours
    assert [line.get_label() for line in fig.axes[0].get_lines()] == [
        "a train",
        "a valid",
        "b train",
    ]
    out = plot_runs([a, b], tmp_path / "c.png")
    assert out.stat().st_size > 1000


def test_a_run_with_no_train_record_is_one_sentence(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    empty = _run(tmp_path / "empty", [])
    (empty / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="hold no train records with a loss"):
        plot_figure([empty])
