"""The dynamic loss scaler: backoff with hysteresis, growth after good steps, state round trip."""

from __future__ import annotations

import re

import pytest
import torch

from mega_zero_optim import DynamicLossScaler


def test_scales_the_loss() -> None:
    scaler = DynamicLossScaler(initial_scale=8.0)
    assert scaler.scale_loss(torch.tensor(1.5)).item() == 12.0


def test_backoff_after_hysteresis_then_each_overflow() -> None:
    scaler = DynamicLossScaler(initial_scale=1024.0, hysteresis=2, growth_interval=3)
    scaler.update(found_inf=True)
    assert scaler.scale == 1024.0  # the first overflow is tolerated
    scaler.update(found_inf=True)
    assert scaler.scale == 512.0
    scaler.update(found_inf=True)
    assert scaler.scale == 256.0  # until the scale grows again, every overflow backs off


def test_growth_after_interval_and_reset_by_overflow() -> None:
    scaler = DynamicLossScaler(initial_scale=4.0, hysteresis=1, growth_interval=3)
    for _ in range(2):
        scaler.update(found_inf=False)
    scaler.update(found_inf=True)  # resets the run of good steps
    assert scaler.scale == 2.0
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 4.0


def test_bounds() -> None:
    scaler = DynamicLossScaler(initial_scale=2.0, min_scale=1.0, max_scale=4.0, hysteresis=1)
    for _ in range(5):
        scaler.update(found_inf=True)
    assert scaler.scale == 1.0
    grow = DynamicLossScaler(initial_scale=2.0, max_scale=4.0, growth_interval=1)
    for _ in range(5):
        grow.update(found_inf=False)
    assert grow.scale == 4.0


def test_state_round_trip() -> None:
    a = DynamicLossScaler(initial_scale=64.0, hysteresis=3, growth_interval=10)
    a.update(found_inf=True)
    a.update(found_inf=False)
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"initial_scale": 0.5}, "0 < min_scale (1.0) <= initial_scale (0.5)"),
        ({"growth_factor": 1.0}, "growth_factor (1.0) must exceed 1"),
        ({"backoff_factor": 1.0}, "backoff_factor (1.0) must lie strictly between 0 and 1"),
        ({"hysteresis": 0}, "hysteresis (0) must be at least 1"),
    ],
)
def test_bad_settings(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        DynamicLossScaler(**kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
