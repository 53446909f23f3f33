"""Schedule orders, pure arithmetic: the textbook 1F1B and interleaved orders, written by hand."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mega_pipeline import (
    Action,
    interleaved_order,
    interleaved_warmup,
    no_pipelining_order,
    one_f_one_b_order,
    peak_in_flight,
    validate_order,
)


def _fmt(actions: list[Action], chunks: bool = False) -> str:
    return " ".join(f"{a.kind}{a.microbatch}" + (f".{a.chunk}" if chunks else "") for a in actions)


def test_no_pipelining_is_gradient_accumulation() -> None:
    assert _fmt(no_pipelining_order(3)) == "F0 B0 F1 B1 F2 B2"
    assert _fmt(no_pipelining_order(3, forward_only=True)) == "F0 F1 F2"


# Narayanan et al. 2021, fig. 3 (1F1B): stage r runs pp - r - 1 warmup forwards.
ONE_F_ONE_B = {
    (4, 0, 8): "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
    (4, 1, 8): "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
    (4, 2, 8): "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
    (4, 3, 8): "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    (4, 0, 2): "F0 F1 B0 B1",  # fewer microbatches than stages: all warmup
    (2, 0, 2): "F0 F1 B0 B1",
    (2, 1, 2): "F0 B0 F1 B1",
    (1, 0, 3): "F0 B0 F1 B1 F2 B2",
}


@pytest.mark.parametrize(("key", "expected"), list(ONE_F_ONE_B.items()), ids=str)
def test_1f1b_textbook_order(key: tuple[int, int, int], expected: str) -> None:
    pp, rank, m = key
    actions = one_f_one_b_order(pp, rank, m)
    assert _fmt(actions) == expected
    validate_order(actions, m, 1, forward_only=False)
    assert _fmt(one_f_one_b_order(pp, rank, m, forward_only=True)) == " ".join(
        f"F{i}" for i in range(m)
    )


# Narayanan et al. 2021, fig. 4 (interleaved): microbatches in groups of pp, forward
# chunks 0..v-1 per group, backward chunks v-1..0; 2(pp-r-1) + (v-1)pp warmup forwards.
INTERLEAVED = {
    (2, 2, 0, 4): "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0",
    (2, 2, 1, 4): "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0",
    # one group (m == pp): every forward first, on every rank
    (2, 2, 1, 2): "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0",
    (4, 2, 3, 4): "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 B0.1 B1.1 B2.1 B3.1 B0.0 B1.0 B2.0 B3.0",
    (4, 2, 0, 8): (
        "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 F4.0 F5.0 "
        "F6.0 B0.1 F7.0 B1.1 F4.1 B2.1 F5.1 B3.1 F6.1 B0.0 F7.1 B1.0 "
        "B2.0 B3.0 B4.1 B5.1 B6.1 B7.1 B4.0 B5.0 B6.0 B7.0"
    ),
    (4, 2, 3, 8): (
        "F0.0 F1.0 F2.0 F3.0 "
        "F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 F4.0 B0.0 F5.0 B1.0 F6.0 B2.0 F7.0 B3.0 "
        "F4.1 B4.1 F5.1 B5.1 F6.1 B6.1 F7.1 B7.1 "
        "B4.0 B5.0 B6.0 B7.0"
    ),
}


@pytest.mark.parametrize(("key", "expected"), list(INTERLEAVED.items()), ids=str)
def test_interleaved_textbook_order(key: tuple[int, int, int, int], expected: str) -> None:
    pp, vpp, rank, m = key
    actions = interleaved_order(pp, vpp, rank, m)
    assert _fmt(actions, chunks=True) == expected
    validate_order(actions, m, vpp, forward_only=False)
    forward = [a for a in actions if a.kind == "F"]
    assert interleaved_order(pp, vpp, rank, m, forward_only=True) == forward


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("vpp", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_orders_are_complete_and_bounded(pp: int, vpp: int, groups: int) -> None:
    m = groups * pp
    for rank in range(pp):
        order = interleaved_order(pp, vpp, rank, m)
        validate_order(order, m, vpp, forward_only=False)
        warm = interleaved_warmup(pp, vpp, rank, m)
        assert [a.kind for a in order[:warm]] == ["F"] * warm
        expected_peak = (
            vpp * m if m == pp else min(2 * (pp - rank - 1) + (vpp - 1) * pp + 1, vpp * m)
        )
        assert peak_in_flight(order) == expected_peak
        if vpp == 1:
            plain = one_f_one_b_order(pp, rank, m)
            validate_order(plain, m, 1, forward_only=False)
            assert peak_in_flight(plain) == min(pp - rank, m)  # <= pp on stage 0


def test_validate_order_rejects_broken_orders() -> None:
    bad = [
        ([Action("B", 0, 0), Action("F", 0, 0)], "runs before its forward"),
        ([Action("F", 0, 0), Action("F", 0, 0)], "runs twice"),
        ([Action("F", 0, 0)], "1 forwards and 0 backwards"),
        ([Action("F", 0, 3), Action("B", 0, 3)], "outside 1 microbatches and 1 chunks"),
    ]
    for actions, message in bad:
        with pytest.raises(ValueError, match=message):
            validate_order(actions, 1, 1, forward_only=False)
    with pytest.raises(ValueError, match="forward-only"):
        validate_order([Action("F", 0, 0), Action("B", 0, 0)], 1, 1, forward_only=True)


def test_order_arguments_checked() -> None:
    cases: list[tuple[Callable[[], object], str]] = [
        (
            lambda: interleaved_order(4, 2, 0, 6),
            r"num_microbatches \(6\) to be a multiple of pp \(4\)",
        ),
        (lambda: one_f_one_b_order(2, 2, 4), r"pp_rank \(2\) must be in 0..1"),
        (lambda: one_f_one_b_order(2, 0, 0), r"num_microbatches \(0\) must be a positive"),
        (lambda: interleaved_order(2, 0, 0, 2), r"vpp \(0\) must be a positive"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert "\n" not in str(info.value)
