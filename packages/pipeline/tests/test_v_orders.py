"""The V orders (ZBV, DualPipeV) as pure functions, and their timed plans.

DualPipeV's order is checked against the published schedule (DeepSeek-AI's DualPipeV: the
eight phases of rank r of p, ``2(p-r-1)`` F0, ``r+1`` F0 F1, ``p-r-1`` B1 W F1, the
``m-2p+r+1`` overlapped F0&B1 F1&B0 pairs, ``p-r-1`` B1 F1&B0, ``r+1`` B1 B0 with the W of
the second half deferred, ``p-r-1`` W B0, ``r+1`` W), written out by hand for p 2, m 4.
Both orders' timed plans (:func:`~mega_pipeline.build_timed_plans`) replay without
deadlock under :func:`~mega_pipeline.simulate_plans`' rendezvous semantics; with unit F, B
and W passes they take ``6m + p - 1`` units, the last rank's start-up wait and nothing more.
"""

from __future__ import annotations

import pytest

from mega_pipeline import (
    Action,
    build_timed_plans,
    dualpipev_order,
    dualpipev_pairs,
    peak_in_flight,
    simulate_plans,
    unit_times,
    validate_order,
    zbv_order,
)

CASES = [(p, m) for p in (2, 4) for m in (2 * p, 4 * p)]


def _parse(text: str) -> list[Action]:
    """``"F0.1"``: forward of microbatch 0, chunk 1; ``|`` separates the phases."""
    out = []
    for token in text.replace("|", " ").split():
        kind, rest = token[0], token[1:]
        mb, chunk = rest.split(".")
        out.append(Action(kind, int(mb), int(chunk)))  # type: ignore[arg-type]
    return out


# p 2, m 4, phase by phase (1 | 2 | 3 | 4 | 5 | 6 | 7 | 8); a B whose W is not deferred
# is followed by its own W. Rank 1 has empty phases 1, 3, 5 and 7.
DUALPIPEV_P2_M4 = {
    0: "F0.0 F1.0 | F2.0 F0.1 | B0.1 W0.1 F1.1 | F3.0 B1.1 W1.1 F2.1 B0.0 W0.0 "
    "| B2.1 W2.1 F3.1 B1.0 W1.0 | B3.1 W3.1 B2.0 | W2.0 B3.0 | W3.0",
    1: "F0.0 F0.1 F1.0 F1.1 | F2.0 B0.1 W0.1 F2.1 B0.0 W0.0 F3.0 B1.1 W1.1 F3.1 B1.0 W1.0 "
    "| B2.1 W2.1 B2.0 W2.0 B3.1 B3.0 | W3.1 W3.0",
}


def test_dualpipev_matches_the_published_schedule() -> None:
    for rank, text in DUALPIPEV_P2_M4.items():
        assert dualpipev_order(2, rank, 4) == _parse(text), rank


@pytest.mark.parametrize(("pp", "m"), CASES)
def test_dualpipev_is_complete_and_ordered(pp: int, m: int) -> None:
    for rank in range(pp):
        order = dualpipev_order(pp, rank, m)
        validate_order(order, m, 2, forward_only=False)
        for kind in "FBW":
            for chunk in (0, 1):  # each chunk runs its micro-batches in order
                mbs = [a.microbatch for a in order if a.kind == kind and a.chunk == chunk]
                assert mbs == list(range(m)) if kind != "W" else sorted(mbs) == list(range(m))
        assert peak_in_flight(order) <= 2 * pp + 1
        pairs = dualpipev_pairs(pp, rank, m)
        # the steady state: m - 2p + r + 1 double pairs (one apart on the last rank), then
        # p - r - 1 single ones
        apart = 1 if rank == pp - 1 else 0
        assert len(pairs) == 2 * (m - 2 * pp + rank + 1) - apart + (pp - rank - 1)
        for i in pairs:
            f, b = order[i], order[i + 1]
            assert f.kind == "F" and b.kind == "B" and f.chunk != b.chunk


@pytest.mark.parametrize("order", [zbv_order, dualpipev_order])
@pytest.mark.parametrize(("pp", "m"), CASES)
def test_v_timed_plans_replay_without_deadlock(order: object, pp: int, m: int) -> None:
    orders = [order(pp, r, m) for r in range(pp)]  # type: ignore[operator]
    plans = build_timed_plans(orders, 2, v_shape=True)
    for rank, plan in enumerate(plans):  # the plan runs the order, nothing else
        assert [s.action for s in plan if s.action is not None] == orders[rank]
    units = simulate_plans(plans, forward_time=1, backward_time=1, weight_time=1)
    assert units == 6 * m + pp - 1
    assert max(max(s) for s in unit_times(orders, 2, v_shape=True)) + 1 == units
    simulate_plans(plans)  # B twice as long as F or W: still no deadlock


def test_zbv_timed_plans_at_m_equal_p() -> None:
    for pp in (2, 4):
        plans = build_timed_plans([zbv_order(pp, r, pp) for r in range(pp)], 2, v_shape=True)
        assert simulate_plans(plans, forward_time=1, backward_time=1, weight_time=1) == 7 * pp - 1


def test_the_last_rank_turns_without_a_message() -> None:
    plans = build_timed_plans([zbv_order(2, r, 2) for r in range(2)], 2, v_shape=True)
    for step in plans[1]:  # rank 1's chunk 0 (stage 1) feeds its chunk 1 (stage 2)
        for message in step.exchange:
            if message is not None:
                assert {message.src_stage, message.dst_stage} != {1, 2}, message


def test_dualpipev_needs_two_pp_microbatches() -> None:
    with pytest.raises(
        ValueError, match=r"DualPipeV needs num_microbatches \(3\) >= 2 \* pp \(4\)"
    ):
        dualpipev_order(2, 0, 3)


def test_timed_plans_refuse_orders_that_wait_forever() -> None:
    orders = [[Action("F", 0, 0), Action("B", 0, 1)], [Action("B", 0, 0), Action("F", 0, 0)]]
    with pytest.raises(ValueError, match="wait on each other forever"):
        build_timed_plans(orders, 2, v_shape=True)


def test_build_plan_v_shape_needs_two_chunks() -> None:
    from mega_pipeline import build_plan

    with pytest.raises(ValueError, match="the V of ZBV/DualPipeV has 2 chunks per rank, not vpp 3"):
        build_plan(zbv_order(2, 0, 2), 2, 3, 0, v_shape=True)
