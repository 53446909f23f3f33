"""Plans for any orders, built from all ranks' orders at once: one exchange per unit of time.

The plans of :func:`~mega_pipeline.build_plan` pair each receive with the action that
needs it, which works for orders whose neighbours agree on when a message moves (1F1B,
the interleaved 1F1B, ZB-H1). The V schedules (ZBV, DualPipeV) send activations and
gradients both ways over each link, and a rank needs them in another order than its
neighbour makes them. Here all ranks' orders are replayed together with unit-time passes
(each pass starts as soon as the rank is free and its inputs exist); at every unit of time
each rank runs one exchange holding what it made in the unit before and what its
neighbours made for it then (received early when it is needed later), then its pass.
Two neighbours' exchanges of one unit always hold the same messages, so the plans cannot
deadlock and a link never carries two messages of one unit, whatever the orders.
"""

from __future__ import annotations

from collections.abc import Sequence

from mega_pipeline.order import Action
from mega_pipeline.plan import Exchange, Message, Step, _produces, _stage, stage_rank

__all__ = ["build_timed_plans", "unit_times"]


def _deps(action: Action, stage: int, stages: int) -> list[tuple[str, int, int]]:
    if action.kind == "F":
        return [("F", action.microbatch, stage - 1)] if stage > 0 else []
    if action.kind == "B":
        after = [("B", action.microbatch, stage + 1)] if stage < stages - 1 else []
        return [("F", action.microbatch, stage), *after]
    return [("B", action.microbatch, stage)]


def unit_times(
    orders: Sequence[Sequence[Action]], vpp: int, *, v_shape: bool = False
) -> list[list[int]]:
    """When each action of each rank's order starts, replayed together with unit passes.

    Raises ValueError when the orders wait on each other forever.
    """
    pp, stages = len(orders), len(orders) * vpp
    done: dict[tuple[str, int, int], int] = {}
    starts: list[list[int]] = [[] for _ in orders]
    clock = [0] * pp
    moved = True
    while moved:
        moved = False
        for rank, order in enumerate(orders):
            while len(starts[rank]) < len(order):
                action = order[len(starts[rank])]
                stage = _stage(pp, rank, action.chunk, v_shape)
                deps = _deps(action, stage, stages)
                if not all(d in done for d in deps):
                    break
                start = max([clock[rank]] + [done[d] for d in deps])
                starts[rank].append(start)
                clock[rank] = done[(action.kind, action.microbatch, stage)] = start + 1
                moved = True
    stuck = [r for r, order in enumerate(orders) if len(starts[r]) < len(order)]
    if stuck:
        detail = ", ".join(f"rank {r} at {orders[r][len(starts[r])]}" for r in stuck)
        raise ValueError(f"the orders wait on each other forever: {detail}")
    return starts


def build_timed_plans(
    orders: Sequence[Sequence[Action]], vpp: int, *, v_shape: bool = False
) -> list[list[Step]]:
    """Every rank's plan for ``orders`` (``orders[r]``: rank ``r``'s), one exchange per unit.

    ``v_shape``: each rank's two chunks form the V (:func:`~mega_pipeline.zbv_stage`).
    """
    pp = len(orders)
    starts = unit_times(orders, vpp, v_shape=v_shape)
    at: list[dict[int, Action]] = [
        dict(zip(s, o, strict=True)) for s, o in zip(starts, orders, strict=True)
    ]
    end = max((max(s) + 1 for s in starts if s), default=0)
    made: list[list[tuple[Message | None, Message | None]]] = [
        [
            _produces(a, pp, vpp, rank, v_shape) if a is not None else (None, None)
            for a in (at[rank].get(t) for t in range(end))
        ]
        for rank in range(pp)
    ]
    plans: list[list[Step]] = []
    for rank in range(pp):
        nxt, prv = (rank + 1) % pp, (rank - 1) % pp
        steps: list[Step] = []
        for t in range(end + 1):
            send_next = send_prev = recv_prev = recv_next = None
            if t > 0 and pp > 1:
                send_next, send_prev = made[rank][t - 1]
                recv_prev = made[prv][t - 1][0]  # what the previous rank sent forward
                recv_next = made[nxt][t - 1][1]  # what the next rank sent back
                assert recv_prev is None or stage_rank(pp, recv_prev.dst_stage, v_shape) == rank
                assert recv_next is None or stage_rank(pp, recv_next.dst_stage, v_shape) == rank
            exchange = Exchange(send_next, send_prev, recv_prev, recv_next)
            action = at[rank].get(t)
            if action is not None or not exchange.is_empty():
                steps.append(Step(exchange, action))
        plans.append(steps)
    return plans
