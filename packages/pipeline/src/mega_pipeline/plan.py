"""Which messages each rank exchanges around each action: a pure plan, and a replay of it.

Before every action a rank runs one batched exchange holding the sends the previous
action produced and the receive the next action needs (Megatron's pattern:
``send_forward_recv_backward`` after a forward, ``send_backward_recv_forward`` after a
backward); in the interleaved steady state a forward and the backward after it share one
exchange. :func:`simulate_plans` replays all ranks' plans with rendezvous semantics (a
send completes only when its receiver's current exchange takes it), rejects plans that
would deadlock or deliver a message to the wrong slot, and returns the time they take.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

from mega_pipeline.order import Action
from mega_pipeline.zero_bubble import zbv_stage

__all__ = [
    "Exchange",
    "Message",
    "Step",
    "build_plan",
    "simulate_plans",
    "stage_rank",
    "virtual_stage",
]


class Message(NamedTuple):
    """One tensor travelling between adjacent virtual stages."""

    kind: Literal["activation", "gradient", "shape"]
    microbatch: int
    src_stage: int
    """Virtual stage that sends it (``chunk * pp + pp_rank``)."""
    dst_stage: int
    """Virtual stage that receives it."""


class Exchange(NamedTuple):
    """One batched exchange with the neighbours; posted in this field order.

    Fields are named for the neighbour: in the straight pipeline (and the interleaved
    one) activations go to the next pp rank and gradients to the previous one; in the V
    of ZBV/DualPipeV chunk 1 runs back, so its activations go to the previous rank and
    its gradients to the next.
    """

    send_next: Message | None
    """Message to the next pp rank (an activation; in the V a chunk-1 gradient)."""
    send_prev: Message | None
    """Message to the previous pp rank (a gradient; in the V a chunk-1 activation)."""
    recv_prev: Message | None
    """Message from the previous pp rank (an activation; in the V a chunk-1 gradient)."""
    recv_next: Message | None
    """Message from the next pp rank (a gradient; in the V a chunk-1 activation)."""

    def is_empty(self) -> bool:
        """True when nothing is sent or received."""
        return self == _EMPTY


_EMPTY = Exchange(None, None, None, None)


class Step(NamedTuple):
    """An exchange, then an action (``None`` for the final exchange that only sends)."""

    exchange: Exchange
    action: Action | None


def virtual_stage(pp: int, pp_rank: int, chunk: int) -> int:
    """Position of chunk ``chunk`` of rank ``pp_rank`` in the model: ``chunk * pp + pp_rank``."""
    return chunk * pp + pp_rank


def _stage(pp: int, pp_rank: int, chunk: int, v_shape: bool) -> int:
    return zbv_stage(pp, pp_rank, chunk) if v_shape else virtual_stage(pp, pp_rank, chunk)


def stage_rank(pp: int, stage: int, v_shape: bool = False) -> int:
    """The pp rank that holds virtual ``stage``: ``stage % pp``, or in the V the mirror
    ``2 pp - 1 - stage`` for the second half."""
    if v_shape and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def _route(message: Message, pp: int, v_shape: bool) -> str | None:
    """``"next"`` or ``"prev"``: the neighbour ``message`` travels to; None when it stays
    on this rank (the V's turn on the last rank)."""
    src = stage_rank(pp, message.src_stage, v_shape)
    dst = stage_rank(pp, message.dst_stage, v_shape)
    if src == dst:
        return None
    if v_shape:  # forward along the V: up through chunk 0, back down through chunk 1
        return "next" if dst == src + 1 else "prev"
    return "next" if message.dst_stage > message.src_stage else "prev"


def _place(
    message: Message | None, pp: int, v_shape: bool
) -> tuple[Message | None, Message | None]:
    """(to or from the next rank, to or from the previous rank)."""
    if message is None:
        return None, None
    route = _route(message, pp, v_shape)
    if route is None:
        return None, None
    return (message, None) if route == "next" else (None, message)


def _produces(
    action: Action, pp: int, vpp: int, pp_rank: int, v_shape: bool = False
) -> tuple[Message | None, Message | None]:
    """(for the next rank, for the previous rank)."""
    s = _stage(pp, pp_rank, action.chunk, v_shape)
    message: Message | None = None
    if action.kind == "F" and s < pp * vpp - 1:
        message = Message("activation", action.microbatch, s, s + 1)
    elif action.kind == "B" and s > 0:
        message = Message("gradient", action.microbatch, s, s - 1)
    return _place(message, pp, v_shape)  # a W's weight gradients stay on the rank


def _needs(
    action: Action, pp: int, vpp: int, pp_rank: int, v_shape: bool = False
) -> tuple[Message | None, Message | None]:
    """(from the previous rank, from the next rank)."""
    s = _stage(pp, pp_rank, action.chunk, v_shape)
    message: Message | None = None
    if action.kind == "F" and s > 0:
        message = Message("activation", action.microbatch, s - 1, s)
    elif action.kind == "B" and s < pp * vpp - 1:
        message = Message("gradient", action.microbatch, s + 1, s)
    if message is None:
        return None, None
    src = stage_rank(pp, message.src_stage, v_shape)
    if src == pp_rank:
        return None, None
    to_next, to_prev = _place(message, pp, v_shape)
    return (to_next, None) if to_next is not None else (None, to_prev)


def build_plan(
    actions: Sequence[Action],
    pp: int,
    vpp: int,
    pp_rank: int,
    *,
    pair_from: int | None = None,
    v_shape: bool = False,
) -> list[Step]:
    """The steps rank ``pp_rank`` runs: before each slot of actions, one exchange.

    A slot is one action, or, from index ``pair_from`` on (the interleaved schedule's
    steady state, after its warmup), an F directly followed by a B. The exchange before a
    slot sends what the previous slot produced and receives what this slot needs; a last
    exchange sends what the last slot produced. The second action of a pair gets an empty
    exchange. Exchanging after every single action is right for 1F1B but deadlocks the
    interleaved steady state, whose pairs wait on each other around the ring.

    W passes (which send and receive nothing) join the slot of the action after them and
    carry its exchange: the executor posts it, runs the W passes while it is in flight and
    waits for it before that action, so a B's gradient leaves at once and the next input
    arrives behind the W passes.

    ``v_shape``: the two chunks of each rank form the V of ZBV and DualPipeV (chunk 1 is
    virtual stage ``2 pp - 1 - pp_rank``, :func:`~mega_pipeline.zbv_stage`); the last
    rank's chunk 0 hands its output to its own chunk 1 with no message.
    """
    if v_shape and vpp != 2:
        raise ValueError(f"the V of ZBV/DualPipeV has 2 chunks per rank, not vpp {vpp}")
    slots: list[list[Action]] = []
    waiting: list[Action] = []  # W passes for the next slot
    for i, action in enumerate(actions):
        pairs = pair_from is not None and i - 1 >= pair_from
        if action.kind == "W":
            waiting.append(action)
        elif pairs and action.kind == "B" and slots and [a.kind for a in slots[-1]] == ["F"]:
            slots[-1].append(action)
        else:
            slots.append([*waiting, action])
            waiting = []
    if waiting:
        slots.append(waiting)
    steps: list[Step] = []
    sends: tuple[Message | None, Message | None] = (None, None)
    for slot in [*slots, []]:
        recv_prev: Message | None = None
        recv_next: Message | None = None
        for action in slot:
            need_prev, need_next = _needs(action, pp, vpp, pp_rank, v_shape)
            assert not (recv_prev and need_prev) and not (recv_next and need_next), slot
            recv_prev = recv_prev or need_prev
            recv_next = recv_next or need_next
        exchange = Exchange(sends[0], sends[1], recv_prev, recv_next)
        steps.append(Step(exchange, slot[0] if slot else None))
        steps += [Step(_EMPTY, action) for action in slot[1:]]
        send_next: Message | None = None
        send_prev: Message | None = None
        for action in slot:
            made_next, made_prev = _produces(action, pp, vpp, pp_rank, v_shape)
            assert not (send_next and made_next) and not (send_prev and made_prev), slot
            send_next = send_next or made_next
            send_prev = send_prev or made_prev
        sends = (send_next, send_prev)
    return steps


def _ops(exchange: Exchange, pp: int, rank: int) -> list[tuple[str, tuple[int, int], Message]]:
    """(direction, channel (src rank, dst rank), message) in posting order."""
    nxt, prv = (rank + 1) % pp, (rank - 1) % pp
    ops: list[tuple[str, tuple[int, int], Message]] = []
    if exchange.send_next is not None:
        ops.append(("send", (rank, nxt), exchange.send_next))
    if exchange.send_prev is not None:
        ops.append(("send", (rank, prv), exchange.send_prev))
    if exchange.recv_prev is not None:
        ops.append(("recv", (prv, rank), exchange.recv_prev))
    if exchange.recv_next is not None:
        ops.append(("recv", (nxt, rank), exchange.recv_next))
    return ops


def _with_shapes(plan: Sequence[Step]) -> list[Step]:
    """The plan as run with variable shapes: each activation preceded by its shape.

    The shapes of an exchange travel in a batch of their own before the payloads; a
    gradient needs none (its receiver knows the shape of the activation it sent).
    """
    steps: list[Step] = []
    for step in plan:
        ex = step.exchange
        if ex.send_next is not None or ex.recv_prev is not None:
            shapes = Exchange(
                ex.send_next and ex.send_next._replace(kind="shape"),
                None,
                ex.recv_prev and ex.recv_prev._replace(kind="shape"),
                None,
            )
            steps.append(Step(shapes, None))
        steps.append(step)
    return steps


def simulate_plans(
    plans: Sequence[Sequence[Step]],
    *,
    variable_shapes: bool = False,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    weight_time: float = 1.0,
) -> float:
    """Replay every rank's plan together; return the time they take, or raise ValueError.

    ``plans[r]`` is rank ``r``'s plan. Messages on a channel (one ordered pair of ranks)
    are matched first-in first-out, as NCCL and gloo match them; each must be received
    as the message it was sent as. A rank finishes an exchange only when all of its
    messages have met their counterpart in the peer's current exchange (rendezvous), so
    plans that pass also run when sends are buffered; plans that would wait forever
    raise. With ``variable_shapes`` the plans are replayed as
    :class:`~mega_pipeline.P2PCommunicator` runs them in that mode.

    Time: each forward of one chunk costs ``forward_time``, each backward
    ``backward_time`` and each W pass of a split backward ``weight_time``; communication
    is free; the result is when the last rank finishes. An exchange before W passes is
    posted and left open while they run, completed before the next other pass, as the
    executor runs it.
    """
    if variable_shapes:
        plans = [_with_shapes(plan) for plan in plans]
    pp = len(plans)
    sent: dict[tuple[int, int], list[Message]] = {}
    received: dict[tuple[int, int], list[Message]] = {}
    # per rank and step: (direction, channel, position among the channel's messages)
    index: list[list[list[tuple[str, tuple[int, int], int]]]] = []
    for rank, plan in enumerate(plans):
        per_step = []
        for step in plan:
            entries = []
            for direction, channel, message in _ops(step.exchange, pp, rank):
                queue = (sent if direction == "send" else received).setdefault(channel, [])
                entries.append((direction, channel, len(queue)))
                queue.append(message)
            per_step.append(entries)
        index.append(per_step)
    for channel in sorted(set(sent) | set(received)):
        out, into = sent.get(channel, []), received.get(channel, [])
        if out != into:
            raise ValueError(
                f"messages from rank {channel[0]} to rank {channel[1]} are sent as {out} "
                f"but received as {into}; the plans disagree"
            )
    position = [0] * pp
    clock = [0.0] * pp  # when each rank posted its current exchange
    done: dict[tuple[int, int], list[float]] = {}  # channel -> match time of each message
    # an exchange posted before W passes stays open while they run (the executor waits for
    # it before the next pass that is not a W): its entries and when it was posted
    open_entries: list[list[tuple[str, tuple[int, int], int]]] = [[] for _ in range(pp)]
    opened_at = [0.0] * pp
    cost = {"F": forward_time, "B": backward_time, "W": weight_time}
    progressed = True
    while progressed:
        progressed = False
        posted: dict[tuple[str, tuple[int, int], int], tuple[int, float]] = {}
        for rank in range(pp):
            for entry in open_entries[rank]:
                posted[entry] = (rank, opened_at[rank])
            if position[rank] < len(plans[rank]):
                for entry in index[rank][position[rank]]:
                    posted[entry] = (rank, clock[rank])
        for (direction, channel, seq), (_, at) in posted.items():
            matched = done.setdefault(channel, [])
            peer = posted.get(("recv", channel, seq))
            if direction == "send" and peer is not None and len(matched) == seq:
                earlier = matched[-1] if matched else 0.0
                matched.append(max(at, peer[1], earlier))
                progressed = True
        for rank in range(pp):
            if position[rank] >= len(plans[rank]):
                continue
            entries = index[rank][position[rank]]
            action = plans[rank][position[rank]].action
            weight = action is not None and action.kind == "W"
            if weight and entries and not open_entries[rank]:  # post, run the W meanwhile
                open_entries[rank], opened_at[rank] = entries, clock[rank]
                clock[rank] += weight_time
                position[rank] += 1
                progressed = True
                continue
            waits = entries if weight else entries + open_entries[rank]
            if all(seq < len(done.get(channel, [])) for _, channel, seq in waits):
                finish = max([clock[rank]] + [done[ch][seq] for _, ch, seq in waits])
                if not weight:
                    open_entries[rank] = []
                if action is not None:
                    finish += cost[action.kind]
                clock[rank] = finish
                position[rank] += 1
                progressed = True
    stuck = [r for r in range(pp) if position[r] < len(plans[r])]
    if stuck:
        detail = ", ".join(f"rank {r} at step {position[r]}" for r in stuck)
        raise ValueError(f"the plans deadlock: {detail} wait for messages never sent in time")
    return max(clock)
