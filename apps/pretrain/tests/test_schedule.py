"""The LR schedule's shape at its corners."""

from __future__ import annotations

import itertools

import pytest

from mega_pretrain.schedule import lr_at


def _lr(step: int, decay: str) -> float:
    return lr_at(step, lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110, decay=decay)


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd"])
def test_warmup_then_decay_to_min(decay: str) -> None:
    assert _lr(0, decay) == pytest.approx(0.1)
    assert _lr(9, decay) == pytest.approx(1.0)
    assert _lr(10, decay) == pytest.approx(1.0)
    assert _lr(110, decay) == pytest.approx(0.1)
    assert _lr(500, decay) == pytest.approx(0.1)
    values = [_lr(s, decay) for s in range(10, 111)]
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(values))


def test_midpoints() -> None:
    assert _lr(60, "cosine") == pytest.approx(0.55)
    assert _lr(60, "linear") == pytest.approx(0.55)
    assert _lr(60, "wsd") == pytest.approx(1.0)  # still stable: decay is the last 20 %
    assert _lr(100, "wsd") == pytest.approx(0.55)
    assert _lr(60, "constant") == 1.0


def test_unknown_decay() -> None:
    with pytest.raises(ValueError, match=r"decay \('exp'\) must be one of"):
        _lr(50, "exp")
