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
deadlock, whatever the orders.

An overlapped pair (DualPipeV's ``F&B``, given by ``pairs``) is one unit: both passes start
when the inputs of both exist, and both of their messages leave in the next unit's
exchange. A unit may then carry two messages over one link in one direction; its exchange
becomes several steps with no action (the last one holding the unit's action), the k-th of
each holding the k-th message of each link and direction in a fixed order that both
neighbours compute alike, so FIFO matching pairs them. The pair's backward follows its
forward as a step with an empty exchange, as :func:`~mega_pipeline.build_plan` writes pairs.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from mega_pipeline.order import Action
from mega_pipeline.plan import _EMPTY, Exchange, Message, Step, _produces, _stage, stage_rank

Pairs = Sequence[Collection[Action]] | None

__all__ = ["build_timed_plans", "unit_times"]


def _deps(action: Action, stage: int, stages: int) -> list[tuple[str, int, int]]:
    if action.kind == "F":
        return [("F", action.microbatch, stage - 1)] if stage > 0 else []
    if action.kind == "B":
        after = [("B", action.microbatch, stage + 1)] if stage < stages - 1 else []
        return [("F", action.microbatch, stage), *after]
    return [("B", action.microbatch, stage)]


def _units(order: Sequence[Action], pairs: Collection[Action]) -> list[list[Action]]:
    """The order cut into units: single actions, and each pair's F with the B after it."""
    units: list[list[Action]] = []
    i = 0
    while i < len(order):
        if order[i] in pairs:
            if i + 1 >= len(order) or order[i].kind != "F" or order[i + 1].kind != "B":
                raise ValueError(f"pair at {order[i]} is not an F directly followed by a B")
            units.append([order[i], order[i + 1]])
            i += 2
        else:
            units.append([order[i]])
            i += 1
    return units


def unit_times(
    orders: Sequence[Sequence[Action]],
    vpp: int,
    *,
    v_shape: bool = False,
    pairs: Pairs = None,
) -> list[list[int]]:
    """When each action of each rank's order starts, replayed together with unit passes.

    ``pairs[r]``: the forwards of rank ``r``'s overlapped pairs (each with the B after it
    one unit). Raises ValueError when the orders wait on each other forever.
    """
    pp, stages = len(orders), len(orders) * vpp
    units = [_units(o, pairs[r] if pairs else ()) for r, o in enumerate(orders)]
    done: dict[tuple[str, int, int], int] = {}
    starts: list[list[int]] = [[] for _ in orders]
    position = [0] * pp
    clock = [0] * pp
    moved = True
    while moved:
        moved = False
        for rank in range(pp):
            while position[rank] < len(units[rank]):
                unit = units[rank][position[rank]]
                keyed = [(a, _stage(pp, rank, a.chunk, v_shape)) for a in unit]
                deps = [d for a, stage in keyed for d in _deps(a, stage, stages)]
                if not all(d in done for d in deps):
                    break
                start = max([clock[rank]] + [done[d] for d in deps])
                for action, stage in keyed:
                    starts[rank].append(start)
                    done[(action.kind, action.microbatch, stage)] = start + 1
                clock[rank] = start + 1
                position[rank] += 1
                moved = True
    stuck = [r for r in range(pp) if position[r] < len(units[r])]
    if stuck:
        detail = ", ".join(f"rank {r} at {units[r][position[r]][0]}" for r in stuck)
        raise ValueError(f"the orders wait on each other forever: {detail}")
    return starts


def _split(ordered: Sequence[list[Message]]) -> list[Exchange]:
    """One exchange per k: the k-th message of each slot (send next, send prev, receive
    from prev, receive from next)."""
    slots = [sorted(messages) for messages in ordered]
    depth = max((len(m) for m in slots), default=0)
    return [Exchange(*(m[k] if k < len(m) else None for m in slots)) for k in range(depth)]


def build_timed_plans(
    orders: Sequence[Sequence[Action]],
    vpp: int,
    *,
    v_shape: bool = False,
    pairs: Pairs = None,
) -> list[list[Step]]:
    """Every rank's plan for ``orders`` (``orders[r]``: rank ``r``'s), one exchange per unit.

    ``v_shape``: each rank's two chunks form the V (:func:`~mega_pipeline.zbv_stage`).
    ``pairs[r]``: the forwards of rank ``r``'s overlapped pairs, each run with the B after
    it as one unit (see the module docstring).
    """
    pp = len(orders)
    starts = unit_times(orders, vpp, v_shape=v_shape, pairs=pairs)
    at: list[dict[int, list[Action]]] = [{} for _ in orders]
    for rank, (s, o) in enumerate(zip(starts, orders, strict=True)):
        for t, action in zip(s, o, strict=True):
            at[rank].setdefault(t, []).append(action)
    end = max((max(s) + 1 for s in starts if s), default=0)
    # made[rank][t]: (messages for the next rank, for the previous rank) made in unit t
    made: list[list[tuple[list[Message], list[Message]]]] = []
    for rank in range(pp):
        per_unit = []
        for t in range(end):
            to_next: list[Message] = []
            to_prev: list[Message] = []
            for action in at[rank].get(t, []):
                n, p = _produces(action, pp, vpp, rank, v_shape)
                to_next += [n] if n is not None else []
                to_prev += [p] if p is not None else []
            per_unit.append((to_next, to_prev))
        made.append(per_unit)
    plans: list[list[Step]] = []
    for rank in range(pp):
        nxt, prv = (rank + 1) % pp, (rank - 1) % pp
        steps: list[Step] = []
        for t in range(end + 1):
            exchanges: list[Exchange] = []
            if t > 0 and pp > 1:
                send_next, send_prev = made[rank][t - 1]
                recv_prev = made[prv][t - 1][0]  # what the previous rank sent forward
                recv_next = made[nxt][t - 1][1]  # what the next rank sent back
                for message in recv_prev + recv_next:
                    assert stage_rank(pp, message.dst_stage, v_shape) == rank, message
                exchanges = _split([send_next, send_prev, recv_prev, recv_next])
            actions = at[rank].get(t, [])
            last = exchanges.pop() if exchanges else _EMPTY
            steps += [Step(exchange, None) for exchange in exchanges]
            if actions:
                steps.append(Step(last, actions[0]))
                steps += [Step(_EMPTY, action) for action in actions[1:]]
            elif not last.is_empty():
                steps.append(Step(last, None))
        plans.append(steps)
    return plans
