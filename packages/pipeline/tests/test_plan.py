"""Exchange plans, pure: every schedule's messages match up, never deadlock, and the
replayed time gives the textbook bubble (pp - 1) / (vpp * m + pp - 1)."""

from __future__ import annotations

import pytest

from mega_pipeline import (
    Action,
    Exchange,
    Message,
    Step,
    build_plan,
    interleaved_order,
    interleaved_warmup,
    one_f_one_b_order,
    simulate_plans,
)


def _plans(pp: int, vpp: int, m: int, forward_only: bool = False) -> list[list[Step]]:
    if vpp == 1:
        return [build_plan(one_f_one_b_order(pp, r, m, forward_only), pp, 1, r) for r in range(pp)]
    return [
        build_plan(
            interleaved_order(pp, vpp, r, m, forward_only),
            pp,
            vpp,
            r,
            pair_from=None if forward_only else interleaved_warmup(pp, vpp, r, m),
        )
        for r in range(pp)
    ]


def test_plan_of_1f1b_first_stage() -> None:
    act = [Message("activation", i, 0, 1) for i in range(2)]
    grad = [Message("gradient", i, 1, 0) for i in range(2)]
    none = Exchange(None, None, None, None)
    assert build_plan(one_f_one_b_order(2, 0, 2), 2, 1, 0) == [
        Step(none, Action("F", 0, 0)),
        Step(Exchange(act[0], None, None, None), Action("F", 1, 0)),
        Step(Exchange(act[1], None, None, grad[0]), Action("B", 0, 0)),  # send fwd, recv bwd
        Step(Exchange(None, None, None, grad[1]), Action("B", 1, 0)),
        Step(none, None),
    ]
    assert build_plan(one_f_one_b_order(2, 1, 2), 2, 1, 1) == [
        Step(Exchange(None, None, act[0], None), Action("F", 0, 0)),
        Step(none, Action("B", 0, 0)),
        Step(Exchange(None, grad[0], act[1], None), Action("F", 1, 0)),  # send bwd, recv fwd
        Step(none, Action("B", 1, 0)),
        Step(Exchange(None, grad[1], None, None), None),
    ]


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("vpp", [1, 2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 3, 4])
def test_plans_run_with_the_textbook_bubble(pp: int, vpp: int, groups: int) -> None:
    m = groups * pp
    plans = _plans(pp, vpp, m)
    f, b = 1.0 / vpp, 2.0 / vpp  # one chunk's share of a stage's forward and backward
    for variable in (False, True):
        t = simulate_plans(plans, variable_shapes=variable, forward_time=f, backward_time=b)
        bubble = 1 - m * vpp * (f + b) / t
        assert bubble == pytest.approx((pp - 1) / (vpp * m + pp - 1), rel=1e-9)
    for variable in (False, True):  # forward only: the pipeline fills once
        t = simulate_plans(_plans(pp, vpp, m, forward_only=True), variable_shapes=variable)
        assert t == pytest.approx(m * vpp + pp - 1)


def _stuck_steps(plans: list[list[Step]]) -> list[int]:
    """Where two ranks' plans stop under rendezvous, derived from the plans alone.

    The k-th message one rank sends meets the k-th message the other receives (one
    channel each way, first-in first-out); a step completes once each of its messages has
    met its counterpart, posted at some step of the peer. So a rank moves past a step once
    the peer has reached the latest of those steps; where neither can move, it is stuck.
    """
    assert len(plans) == 2
    posted: list[dict[str, list[int]]] = []  # rank -> direction -> step of each message
    for plan in plans:
        steps: dict[str, list[int]] = {"send": [], "recv": []}
        for i, step in enumerate(plan):
            ex = step.exchange
            steps["send"] += [i] * sum(m is not None for m in (ex.send_next, ex.send_prev))
            steps["recv"] += [i] * sum(m is not None for m in (ex.recv_prev, ex.recv_next))
        posted.append(steps)
    # needs[r][i]: the latest peer step that rank r's step i waits for (-1: none)
    needs: list[list[int]] = []
    for r, plan in enumerate(plans):
        peer, latest = posted[1 - r], [-1] * len(plan)
        for mine, theirs in (("send", "recv"), ("recv", "send")):
            for k, i in enumerate(posted[r][mine]):
                latest[i] = max(latest[i], peer[theirs][k])
        needs.append(latest)
    position, moved = [0, 0], True
    while moved:
        moved = False
        for r in (0, 1):
            while position[r] < len(plans[r]) and needs[r][position[r]] <= position[1 - r]:
                position[r] += 1
                moved = True
    return position


def test_unpaired_interleaved_steady_state_deadlocks() -> None:
    """Exchanging after every single action (fine for 1F1B) hangs the interleaved order."""
    paired = _plans(2, 2, 4)
    assert _stuck_steps(paired) == [len(p) for p in paired]  # the derivation lets them finish
    plans = [build_plan(interleaved_order(2, 2, r, 4), 2, 2, r) for r in range(2)]
    stuck = _stuck_steps(plans)
    assert all(s < len(p) for s, p in zip(stuck, plans, strict=True)), stuck
    detail = ", ".join(f"rank {r} at step {s}" for r, s in enumerate(stuck))
    with pytest.raises(ValueError, match=f"^the plans deadlock: {detail} wait for messages"):
        simulate_plans(plans)


def test_plans_in_disagreement_are_caught() -> None:
    plans = _plans(2, 1, 2)
    order = one_f_one_b_order(2, 1, 2)
    swapped = [order[2], order[3], order[0], order[1]]  # rank 1 takes microbatch 1 first
    plans[1] = build_plan(swapped, 2, 1, 1)
    with pytest.raises(ValueError, match="messages from rank 0 to rank 1 are sent as") as info:
        simulate_plans(plans)
    assert "\n" not in str(info.value)
