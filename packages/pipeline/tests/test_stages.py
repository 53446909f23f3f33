"""Splitting N layers into pp * vpp stages: pure arithmetic."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mega_pipeline import rank_layer_ranges, split_layers


def test_even_split() -> None:
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_layers(8, 2, vpp=2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_layers(3, 1) == [range(0, 3)]
    assert split_layers(3, 1, vpp=1) == [range(0, 3)]


def test_chunks_of_a_rank_are_strided_by_pp() -> None:
    # virtual stage s = chunk * pp + rank
    assert rank_layer_ranges(8, 2, 0, vpp=2) == [range(0, 2), range(4, 6)]
    assert rank_layer_ranges(8, 2, 1, vpp=2) == [range(2, 4), range(6, 8)]
    assert rank_layer_ranges(12, 3, 2, vpp=2) == [range(4, 6), range(10, 12)]
    assert rank_layer_ranges(6, 2, 1) == [range(3, 6)]
    layers = sorted(i for r in range(4) for rng in rank_layer_ranges(16, 4, r, 2) for i in rng)
    assert layers == list(range(16))


def test_explicit_split() -> None:
    assert split_layers(10, 4, split=[2, 3, 3, 2]) == [
        range(0, 2),
        range(2, 5),
        range(5, 8),
        range(8, 10),
    ]
    assert rank_layer_ranges(5, 2, 1, vpp=2, split=[1, 2, 2, 0]) == [range(1, 3), range(5, 5)]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: split_layers(10, 4),
            r"num_layers \(10\) does not divide evenly into pp\*vpp \(4\*1 = 4\) stages; "
            r"choose a multiple of 4 or pass split=",
        ),
        (lambda: split_layers(8, 2, vpp=3), r"pp\*vpp \(2\*3 = 6\)"),
        (
            lambda: split_layers(8, 1, vpp=2),
            r"vpp \(2\) needs pipeline parallelism, but pp is 1; set pp > 1 or leave vpp unset",
        ),
        (
            lambda: split_layers(8, 2, split=[4, 4, 0]),
            r"split \[4, 4, 0\] must list 2 non-negative",
        ),
        (lambda: split_layers(8, 2, split=[5, 4]), r"adds up to 9 layers, but num_layers is 8"),
        (lambda: split_layers(0, 2), r"num_layers \(0\) must be a positive integer"),
        (lambda: split_layers(8, 0), r"pp \(0\) must be a positive integer"),
        (lambda: rank_layer_ranges(8, 2, 2), r"pp_rank \(2\) must be in 0..1"),
    ],
)
def test_bad_splits_say_why(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "\n" not in str(info.value)
