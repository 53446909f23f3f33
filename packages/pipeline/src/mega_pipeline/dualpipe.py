"""DualPipeV (DeepSeek-AI, 2025: the V-shaped DualPipe of DeepSeek-V3) as a pure order.

Two chunks per rank in the V of ZBV (:func:`~mega_pipeline.zbv_stage`), micro-batches fed
from rank 0 only. Rank ``r`` of ``p`` runs eight phases, each a number of repeats of a
short pattern (``F0``: forward of chunk 0, ``B1``: backward of chunk 1, ``W``: the oldest
pending weight-gradient pass, ``F0&B1``: a forward and a backward of two micro-batches
meant to overlap):

1. ``2 (p - r - 1)`` x ``F0``
2. ``r + 1`` x ``F0 F1``
3. ``p - r - 1`` x ``B1 W F1`` (B split, its W at once: zero bubble)
4. ``m - 2p + r + 1`` x ``F0&B1 F1&B0`` (the steady state)
5. ``p - r - 1`` x ``B1 F1&B0``
6. ``r + 1`` x ``B1 B0``, the second half with the W deferred
7. ``p - r - 1`` x ``W B0`` (B split)
8. ``r + 1`` x ``W``

Each chunk runs its micro-batches in order. A backward whose W is not deferred is written
as ``B`` directly followed by its own ``W`` (the fused backward), so every order holds one
W per B and :func:`~mega_pipeline.validate_order` accepts it. Needs ``m >= 2 p``.
"""

from __future__ import annotations

from mega_pipeline.order import Action, _check_common

__all__ = ["dualpipev_order", "dualpipev_pairs"]


class _Builder:
    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.pairs: list[int] = []  # index of each overlapped pair's forward
        self.next = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
        self.waiting: list[Action] = []

    def forward(self, chunk: int) -> None:
        mb = self.next[("F", chunk)]
        self.next[("F", chunk)] += 1
        self.actions.append(Action("F", mb, chunk))

    def backward(self, chunk: int, defer: bool) -> None:
        mb = self.next[("B", chunk)]
        self.next[("B", chunk)] += 1
        self.actions.append(Action("B", mb, chunk))
        if defer:
            self.waiting.append(Action("W", mb, chunk))
        else:
            self.actions.append(Action("W", mb, chunk))

    def weight(self) -> None:
        self.actions.append(self.waiting.pop(0))

    def pair(self, forward: int, backward: int) -> None:
        self.pairs.append(len(self.actions))
        self.forward(forward)
        self.backward(backward, defer=False)


def _build(pp: int, pp_rank: int, num_microbatches: int) -> _Builder:
    _check_common(num_microbatches, pp, pp_rank)
    p, r, m = pp, pp_rank, num_microbatches
    if m < 2 * p:
        raise ValueError(
            f"DualPipeV needs num_microbatches ({m}) >= 2 * pp ({2 * p}); raise the number "
            f"of micro-batches to at least {2 * p}"
        )
    o = _Builder()
    for _ in range(2 * (p - r - 1)):  # 1
        o.forward(0)
    for _ in range(r + 1):  # 2
        o.forward(0)
        o.forward(1)
    for _ in range(p - r - 1):  # 3
        o.backward(1, defer=True)
        o.weight()
        o.forward(1)
    for i in range(m - 2 * p + r + 1):  # 4
        if i == 0 and r == p - 1:  # the turn's first pair runs apart, as in DualPipeV
            o.forward(0)
            o.backward(1, defer=False)
        else:
            o.pair(0, 1)
        o.pair(1, 0)
    for _ in range(p - r - 1):  # 5
        o.backward(1, defer=False)
        o.pair(1, 0)
    defer = False
    for i in range(r + 1):  # 6: from the middle on, the W passes wait
        if i == (r + 1) // 2 and r % 2 == 1:
            defer = True
        o.backward(1, defer)
        if i == (r + 1) // 2 and r % 2 == 0:
            defer = True
        o.backward(0, defer)
    for _ in range(p - r - 1):  # 7
        o.weight()
        o.backward(0, defer=True)
    for _ in range(r + 1):  # 8
        o.weight()
    assert not o.waiting
    return o


def dualpipev_order(pp: int, pp_rank: int, num_microbatches: int) -> list[Action]:
    """DualPipeV on rank ``pp_rank``: its F, B and W passes in order (chunk 1 runs back)."""
    return _build(pp, pp_rank, num_microbatches).actions


def dualpipev_pairs(pp: int, pp_rank: int, num_microbatches: int) -> list[int]:
    """Indices in :func:`dualpipev_order` of each overlapped pair's forward (its backward
    follows it)."""
    return _build(pp, pp_rank, num_microbatches).pairs
