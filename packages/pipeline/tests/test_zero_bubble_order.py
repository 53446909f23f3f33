"""Zero-bubble orders (ZB-H1, ZBV) as pure functions: complete, causal, bounded, bubble as promised.

All ranks' orders are replayed together with unit-time F, B and W passes (a chunk's pass
for ZBV) and free communication: an F needs the previous virtual stage's F of the same
microbatch, a B the next stage's B (and its own F), a W its B. The bubble figures are the
Zero Bubble paper's (Qi et al., 2023) for T_F = T_B = T_W: 1F1B idles 3 (p - 1) units per
rank, ZB-H1 p - 1 (its formula (p - 1)(T_F + T_B - T_W)); ZBV only the p - 1 chunk-units
the last rank must wait for its first input, the least any schedule can idle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from mega_pipeline import (
    Action,
    build_plan,
    one_f_one_b_order,
    peak_in_flight,
    simulate_plans,
    validate_order,
    zb_h1_order,
    zbv_order,
    zbv_stage,
)

CASES = [(p, m) for p in (2, 4) for m in (p, 2 * p, 4 * p)]


def _replay(
    orders: Sequence[Sequence[Action]], stages: int, stage_of: Callable[[int, int], int]
) -> float:
    """Finish time of all ranks' orders replayed together (unit passes); fails on a deadlock."""
    done: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * len(orders), [0.0] * len(orders)
    moved = True
    while moved:
        moved = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                a = order[pos[r]]
                s = stage_of(r, a.chunk)
                if a.kind == "F":
                    deps = [("F", a.microbatch, s - 1)] if s > 0 else []
                elif a.kind == "B":
                    after = [("B", a.microbatch, s + 1)] if s < stages - 1 else []
                    deps = [("F", a.microbatch, s), *after]
                else:
                    deps = [("B", a.microbatch, s)]
                if not all(d in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = done[(a.kind, a.microbatch, s)] = start + 1
                pos[r] += 1
                moved = True
    stuck = [r for r, order in enumerate(orders) if pos[r] < len(order)]
    assert not stuck, f"ranks {stuck} wait for a pass that never runs"
    return max(clock)


def _fmt(actions: Sequence[Action], chunks: bool = False) -> str:
    return " ".join(f"{a.kind}{a.microbatch}" + (f".{a.chunk}" if chunks else "") for a in actions)


@pytest.mark.parametrize(("p", "m"), CASES)
def test_zb_h1_is_complete_bounded_and_has_a_third_of_the_bubble(p: int, m: int) -> None:
    orders = [zb_h1_order(p, r, m) for r in range(p)]
    for order in orders:
        validate_order(order, m, 1, forward_only=False)
        assert peak_in_flight(order) <= p  # 1F1B's memory: its first stage's p microbatches
        kinds = [a for a in order if a.kind != "W"]
        assert kinds == [a for a in one_f_one_b_order(p, orders.index(order), m)]
    time = _replay(orders, p, lambda r, c: r)
    assert time - 3 * m == p - 1  # every rank idles p - 1 units
    # 1F1B with its fused backward (2 units) idles 3 (p - 1)
    fused = [one_f_one_b_order(p, r, m) for r in range(p)]
    plans = [build_plan(o, p, 1, r) for r, o in enumerate(fused)]
    assert simulate_plans(plans) - 3 * m == 3 * (p - 1)
    # the exchange plans (rendezvous, FIFO channels; an exchange before W passes posted and
    # completed after them, as the executor runs it) take exactly that time, deadlock-free
    zb_plans = [build_plan(o, p, 1, r) for r, o in enumerate(orders)]
    assert simulate_plans(zb_plans, backward_time=1.0) == time
    # variable shapes: each shape message is a blocking batch of its own (1F1B's lockstep)
    variable = simulate_plans(zb_plans, backward_time=1.0, variable_shapes=True)
    assert time <= variable <= 3 * m + 3 * (p - 1)


def test_zb_h1_textbook_shape() -> None:
    """Rank r is 1F1B with its W passes r microbatches late, caught up in the cool-down."""
    assert _fmt(zb_h1_order(4, 0, 4)) == "F0 F1 F2 F3 B0 W0 B1 W1 B2 W2 B3 W3"
    assert _fmt(zb_h1_order(4, 1, 4)) == "F0 F1 F2 B0 F3 B1 W0 B2 W1 B3 W2 W3"
    assert _fmt(zb_h1_order(4, 2, 4)) == "F0 F1 B0 F2 B1 F3 B2 W0 B3 W1 W2 W3"
    assert _fmt(zb_h1_order(4, 3, 4)) == "F0 B0 F1 B1 F2 B2 F3 B3 W0 W1 W2 W3"
    assert _fmt(zb_h1_order(2, 0, 1)) == "F0 B0 W0"


@pytest.mark.parametrize(("p", "m"), CASES)
def test_zbv_is_complete_bounded_and_idles_only_at_start_up(p: int, m: int) -> None:
    orders = [zbv_order(p, r, m) for r in range(p)]
    for order in orders:
        validate_order(order, m, 2, forward_only=False)
        assert peak_in_flight(order) <= 2 * p  # 2p chunks: p stages' worth, 1F1B's peak
    time = _replay(orders, 2 * p, lambda r, c: zbv_stage(p, r, c))
    assert time - 6 * m == p - 1  # the last rank's wait for its first input, nothing more
    # the V: rank r holds stages r and 2p-1-r; the last rank hands chunk 0 to its chunk 1
    assert [zbv_stage(p, r, c) for r in range(p) for c in (0, 1)] == [
        s for r in range(p) for s in (r, 2 * p - 1 - r)
    ]
    assert zbv_order(p, p - 1, m)[:2] == [Action("F", 0, 0), Action("F", 0, 1)]


def test_zbv_first_rank_starts_and_ends_the_model() -> None:
    order = zbv_order(2, 0, 2)
    assert _fmt(order, chunks=True) == (
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 W0.0 B1.0 W0.1 W1.0 W1.1"
    ), _fmt(order, chunks=True)


def test_zero_bubble_orders_check_their_arguments() -> None:
    for build in (zb_h1_order, zbv_order):
        with pytest.raises(ValueError, match=r"pp_rank \(2\) must be in 0..1 for pp=2"):
            build(2, 2, 4)
        with pytest.raises(ValueError, match=r"num_microbatches \(0\) must be a positive"):
            build(2, 0, 0)


def test_validate_order_checks_w_passes() -> None:
    f, b, w = Action("F", 0, 0), Action("B", 0, 0), Action("W", 0, 0)
    with pytest.raises(ValueError, match="before its backward"):
        validate_order([f, w, b], 1, 1, forward_only=False)
    with pytest.raises(ValueError, match="runs before its backward or twice"):
        validate_order([f, b, w, w], 1, 1, forward_only=False)
    f1, b1 = Action("F", 1, 0), Action("B", 1, 0)
    with pytest.raises(ValueError, match="1 weight-gradient passes"):
        validate_order([f, b, w, f1, b1], 2, 1, forward_only=False)
