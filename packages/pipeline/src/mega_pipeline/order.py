"""Schedule orders as pure arithmetic: the (F/B, microbatch, chunk) actions each rank runs.

No processes, no tensors. The executor follows these lists, and the tests compare them
with the textbook orders (Narayanan et al., 2021: 1F1B and the interleaved 1F1B of
Megatron-LM).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

__all__ = [
    "Action",
    "interleaved_order",
    "interleaved_warmup",
    "no_pipelining_order",
    "one_f_one_b_order",
    "peak_in_flight",
    "validate_order",
]


class Action(NamedTuple):
    """One step of a rank's schedule: a forward or backward pass of one microbatch."""

    kind: Literal["F", "B", "W"]
    """``"F"`` forward, ``"B"`` backward (input gradients; with no ``"W"`` in the order, weight
    gradients too), ``"W"`` the deferred weight-gradient pass of a split backward."""
    microbatch: int
    """Index of the microbatch, 0-based."""
    chunk: int
    """Index of the model chunk on this rank (0 unless the schedule is interleaved)."""


def _check_common(num_microbatches: int, pp: int, pp_rank: int) -> None:
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches ({num_microbatches!r}) must be a positive integer")
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp ({pp!r}) must be a positive integer")
    if not isinstance(pp_rank, int) or not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank ({pp_rank!r}) must be in 0..{pp - 1} for pp={pp}")


def no_pipelining_order(num_microbatches: int, forward_only: bool = False) -> list[Action]:
    """Plain gradient accumulation: F0 B0 F1 B1 ... on one stage."""
    _check_common(num_microbatches, 1, 0)
    actions: list[Action] = []
    for i in range(num_microbatches):
        actions.append(Action("F", i, 0))
        if not forward_only:
            actions.append(Action("B", i, 0))
    return actions


def one_f_one_b_order(
    pp: int, pp_rank: int, num_microbatches: int, forward_only: bool = False
) -> list[Action]:
    """1F1B: ``min(pp - pp_rank - 1, m)`` warmup forwards, then F/B pairs, then cooldown B.

    Stage ``pp_rank`` never holds more than ``pp - pp_rank`` microbatches' activations.
    """
    _check_common(num_microbatches, pp, pp_rank)
    m = num_microbatches
    if forward_only:
        return [Action("F", i, 0) for i in range(m)]
    warmup = min(pp - pp_rank - 1, m)
    actions = [Action("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [Action("F", warmup + i, 0), Action("B", i, 0)]
    actions += [Action("B", i, 0) for i in range(m - warmup, m)]
    return actions


def interleaved_warmup(pp: int, vpp: int, pp_rank: int, num_microbatches: int) -> int:
    """Forward passes rank ``pp_rank`` runs before its first backward in the interleaved 1F1B.

    ``2 * (pp - pp_rank - 1) + (vpp - 1) * pp``, capped at the ``vpp * m`` passes there are:
    the first chunk of every microbatch group must reach the last virtual stage and come
    back before this rank's first backward. With a single group (``m == pp``) every
    forward runs first, as in Megatron-LM: the steady-state pairs would otherwise wait
    on each other around the ring.
    """
    total = vpp * num_microbatches
    if num_microbatches == pp:
        return total
    return min(2 * (pp - pp_rank - 1) + (vpp - 1) * pp, total)


def _interleaved_slot(k: int, pp: int, vpp: int, backward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of the ``k``-th forward (or backward) pass in interleaved order."""
    group, within = divmod(k, pp * vpp)
    chunk = within // pp
    if backward:
        chunk = vpp - 1 - chunk
    return group * pp + within % pp, chunk


def interleaved_order(
    pp: int, vpp: int, pp_rank: int, num_microbatches: int, forward_only: bool = False
) -> list[Action]:
    """Interleaved 1F1B: each rank holds ``vpp`` chunks; microbatches go in groups of ``pp``.

    Forward passes run group by group, chunk 0 to ``vpp - 1`` for the ``pp`` microbatches
    of a group; backward passes likewise with the chunks reversed. After
    :func:`interleaved_warmup` forwards, each forward is followed by one backward.
    """
    _check_common(num_microbatches, pp, pp_rank)
    if not isinstance(vpp, int) or vpp < 1:
        raise ValueError(f"vpp ({vpp!r}) must be a positive integer")
    if num_microbatches % pp:
        raise ValueError(
            f"the interleaved schedule needs num_microbatches ({num_microbatches}) to be a "
            f"multiple of pp ({pp}); use a multiple of {pp} microbatches"
        )
    total = vpp * num_microbatches
    fwd = [Action("F", *_interleaved_slot(k, pp, vpp, False)) for k in range(total)]
    if forward_only:
        return fwd
    bwd = [Action("B", *_interleaved_slot(k, pp, vpp, True)) for k in range(total)]
    warmup = interleaved_warmup(pp, vpp, pp_rank, num_microbatches)
    actions = fwd[:warmup]
    for i in range(total - warmup):
        actions += [fwd[warmup + i], bwd[i]]
    actions += bwd[total - warmup :]
    return actions


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most (microbatch, chunk) pairs whose forward has run and backward has not, at once.

    In an order with W passes a pair stays in flight until its W (whose saved inputs are
    activations too).
    """
    release = "W" if any(a.kind == "W" for a in actions) else "B"
    live: set[tuple[int, int]] = set()
    peak = 0
    for action in actions:
        key = (action.microbatch, action.chunk)
        if action.kind == "F":
            live.add(key)
            peak = max(peak, len(live))
        elif action.kind == release:
            live.discard(key)
    return peak


def validate_order(
    actions: Sequence[Action], num_microbatches: int, num_chunks: int, forward_only: bool
) -> None:
    """Check that ``actions`` runs each (microbatch, chunk) forward once, then backward once.

    An order with W passes runs each pair's W once, after its B. For schedules written by
    hand; raises ValueError naming the first offending action.
    """
    done_f: set[tuple[int, int]] = set()
    done_b: set[tuple[int, int]] = set()
    done_w: set[tuple[int, int]] = set()
    for action in actions:
        key = (action.microbatch, action.chunk)
        if not (0 <= action.microbatch < num_microbatches and 0 <= action.chunk < num_chunks):
            raise ValueError(
                f"{action} is outside {num_microbatches} microbatches and {num_chunks} chunks"
            )
        if action.kind == "F":
            if key in done_f:
                raise ValueError(f"{action} runs twice; each forward must run once")
            done_f.add(key)
        elif action.kind == "W":
            if key not in done_b or key in done_w:
                raise ValueError(f"{action} runs before its backward or twice; fix the order")
            done_w.add(key)
        else:
            if forward_only:
                raise ValueError(f"{action} is a backward pass in a forward-only schedule")
            if key not in done_f or key in done_b:
                raise ValueError(f"{action} runs before its forward or twice; fix the order")
            done_b.add(key)
    expected = num_microbatches * num_chunks
    if done_w and len(done_w) != expected:
        raise ValueError(
            f"the order runs {len(done_w)} weight-gradient passes, but {num_microbatches} "
            f"microbatches x {num_chunks} chunks need {expected} (or none, for a fused backward)"
        )
    if len(done_f) != expected or (not forward_only and len(done_b) != expected):
        raise ValueError(
            f"the order runs {len(done_f)} forwards and {len(done_b)} backwards, "
            f"but {num_microbatches} microbatches x {num_chunks} chunks need {expected} of each"
        )
