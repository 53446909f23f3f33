"""Zero-bubble schedule orders (Qi et al., 2023): the backward split into B and W passes.

``B`` computes a stage's input gradient, which the previous stage waits for; ``W`` its
weight gradients, which nothing waits for, so W passes can fill the bubbles of 1F1B.

- **ZB-H1**: 1F1B with each backward split, rank ``r`` keeping its ``r`` latest W passes
  pending through the steady state and running them in the cool-down, where 1F1B waits.
  Activations in flight (forward run, W not yet) stay at most ``pp`` on every rank, as
  in 1F1B's first stage; with unit-time F, B and W the run takes ``3m + pp - 1`` units,
  a bubble of ``pp - 1`` per rank against 1F1B's ``3 (pp - 1)``.
- **ZBV**: two chunks per rank in a V: chunk 0 is virtual stage ``r`` (ranks 0..pp-1),
  chunk 1 virtual stage ``2 pp - 1 - r`` (back from pp-1 to 0), so the last rank hands
  its chunk-0 output to its own chunk 1 and the first rank both starts and ends the
  model. The order comes from list-scheduling all ranks together with unit-time passes
  (a ready B first, then a forward while fewer than ``2 pp`` chunks are in flight, then
  a W); it takes ``6m + pp - 1`` chunk-units, the start-up delay of the last rank and
  nothing more, at most ``2 pp`` chunks (``pp`` stages' worth) of activations per rank.

Both are pure functions of ``(pp, pp_rank, m)``. The times above assume a pass starts as
soon as its inputs exist; the executor gets there for ZB-H1 by posting the exchange before
W passes and waiting for it after them (:func:`~mega_pipeline.simulate_plans` replays its
plans in exactly ``3m + pp - 1``; with variable shapes the blocking shape messages keep it
nearer 1F1B's time).
"""

from __future__ import annotations

from functools import cache

from mega_pipeline.order import Action, _check_common

__all__ = ["zb_h1_order", "zbv_order", "zbv_stage"]


def zb_h1_order(pp: int, pp_rank: int, num_microbatches: int) -> list[Action]:
    """ZB-H1 on rank ``pp_rank``: 1F1B's forwards and input backwards, W passes ``pp_rank`` late."""
    _check_common(num_microbatches, pp, pp_rank)
    m = num_microbatches
    warmup = min(pp - pp_rank - 1, m)
    actions = [Action("F", i, 0) for i in range(warmup)]
    pending: list[int] = []

    def backward(i: int) -> None:
        actions.append(Action("B", i, 0))
        pending.append(i)
        if len(pending) > pp_rank:
            actions.append(Action("W", pending.pop(0), 0))

    for i in range(m - warmup):
        actions.append(Action("F", warmup + i, 0))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    actions += [Action("W", i, 0) for i in pending]
    return actions


def zbv_stage(pp: int, pp_rank: int, chunk: int) -> int:
    """Virtual stage of ``chunk`` on ``pp_rank`` in the V: ``pp_rank``, or ``2 pp - 1 - pp_rank``."""
    return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank


def zbv_order(pp: int, pp_rank: int, num_microbatches: int) -> list[Action]:
    """ZBV on rank ``pp_rank``: this rank's part of the list schedule of all ranks."""
    _check_common(num_microbatches, pp, pp_rank)
    return list(_zbv_orders(pp, num_microbatches)[pp_rank])


_PRIORITY = {"B": 0, "F": 1, "W": 2}


@cache
def _zbv_orders(pp: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's ZBV order: at each unit of time each idle rank takes its most urgent ready
    pass (B, then F under the memory cap, then W; at a tie the oldest microbatch, then the
    earlier stage)."""
    stages = 2 * pp
    done: dict[tuple[str, int, int], int] = {}  # (kind, microbatch, stage) -> finish time
    nxt = {kind: [0] * stages for kind in "FBW"}  # each stage runs its microbatches in order
    live, free = [0] * pp, [0] * pp
    orders: list[list[Action]] = [[] for _ in range(pp)]
    never = 1 << 62

    def ready(kind: str, mb: int, s: int, t: int, rank: int) -> bool:
        if kind == "F":
            return (s == 0 or done.get(("F", mb, s - 1), never) <= t) and live[rank] < stages
        if kind == "B":
            after = s == stages - 1 or done.get(("B", mb, s + 1), never) <= t
            return after and done.get(("F", mb, s), never) <= t
        return done.get(("B", mb, s), never) <= t

    t, remaining = 0, 3 * m * stages
    while remaining:
        for rank in range(pp):
            if free[rank] > t:
                continue
            options = [
                (_PRIORITY[kind], nxt[kind][s], s, kind, chunk)
                for chunk in (0, 1)
                for s in (zbv_stage(pp, rank, chunk),)
                for kind in "FBW"
                if nxt[kind][s] < m and ready(kind, nxt[kind][s], s, t, rank)
            ]
            if not options:
                continue
            _, mb, s, kind, chunk = min(options)
            done[(kind, mb, s)] = free[rank] = t + 1
            nxt[kind][s] += 1
            live[rank] += {"F": 1, "B": 0, "W": -1}[kind]
            orders[rank].append(Action(kind, mb, chunk))  # type: ignore[arg-type]
            remaining -= 1
        t += 1
        assert t <= 9 * m * stages, "the list schedule made no progress"
    return tuple(tuple(o) for o in orders)
