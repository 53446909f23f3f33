"""Token dispatchers: permute tokens by expert, move them over ep (and etp), and back.

The four beats of an MoE layer are route -> dispatch -> experts -> combine. ``dispatch``
returns the tokens of this rank's local experts in expert-major order with one count per
local expert; ``combine`` takes the experts' output in that order and returns ``[N, h]``,
each token the sum of its experts' outputs times the router's weights.

Expert tensor parallelism: the ranks of ``etp_group`` hold slices of the same experts.
Each gathers the tokens of the whole etp group (an uneven all-gather) before the experts,
and the experts' partial outputs are reduce-scattered back after them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from mega_moe._comm import (
    Group,
    all_gather_no_grad,
    all_gather_sizes,
    all_to_all,
    all_to_all_no_grad,
    check_group,
    gather_rows,
    gather_rows_no_grad,
    group_rank,
    group_size,
    reduce_scatter_rows,
)
from mega_moe._permute import Permutation, capacity_slots, chunk_permutation, sort_by_expert
from mega_moe.fp8_rows import FP8_ROW_ALIGN
from mega_moe.router import Routing

__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "Dispatched"]


@dataclass(frozen=True)
class _EtpState:
    sizes: list[int]  # rows each etp rank contributed
    perm: Tensor | None  # (t, s, l) -> (l, t, s) row order, None when already in order
    inverse: Tensor | None


@dataclass(frozen=True)
class Dispatched:
    """The local experts' input, and what :meth:`combine` needs to undo the dispatch."""

    tokens: Tensor
    """``[M, h]``: the rows of local expert 0, then of local expert 1, ..."""
    counts: list[int] | Tensor
    """Rows per local expert (sums to M): on the host, or ``[L]`` on the device when no
    collective needed the sizes (one rank holds every expert)."""
    side: Tensor | None
    """The result of the ``during`` callable, computed while the dispatch was in flight."""
    perm: Permutation
    weights: Tensor
    etp: _EtpState
    splits: tuple[list[int], list[int]]  # (sent per ep rank, received per ep rank)
    aligned: bool = False
    """Every local expert's block is a multiple of 16 rows (zero rows in the gaps): the
    dispatcher laid the tokens out for the FP8 experts' grouped GEMMs (``row_align``)."""


def _to_experts(
    received: Tensor, chunks: Tensor, host: list[int], etp: Group
) -> tuple[Tensor, list[int], _EtpState]:
    """Gather over etp, then sort row chunks from (etp rank, source, expert) to expert-major.

    ``chunks [T, S, L]`` (device) and ``host`` (the same, flattened, on the host) count the
    rows of each (etp rank, source, local expert) chunk.
    """
    t, s, local = chunks.shape
    per_rank = len(host) // t
    sizes = [sum(host[r * per_rank : (r + 1) * per_rank]) for r in range(t)]
    gathered = gather_rows(received, sizes, etp)  # [rows of this rank] -> [rows of all etp]
    counts = [sum(host[i] for i in range(e, len(host), local)) for e in range(local)]
    if t * s == 1 or local == 1:
        return gathered, counts, _EtpState(sizes, None, None)
    perm, inverse = chunk_permutation(chunks.view(t * s, local), sum(sizes))
    return gathered.index_select(0, perm), counts, _EtpState(sizes, perm, inverse)


def _from_experts(y: Tensor, state: _EtpState, etp: Group) -> Tensor:
    """Undo :func:`_to_experts`: back to (etp rank, source, expert) order, reduce-scatter."""
    if state.inverse is not None:
        y = y.index_select(0, state.inverse)
    return reduce_scatter_rows(y, state.sizes, etp)  # partial sums over etp -> own rows


class _Dispatcher:
    def __init__(
        self, num_experts: int, *, ep_group: Group, etp_group: Group, row_align: int = 1
    ) -> None:
        owner = type(self).__name__
        if row_align not in (1, FP8_ROW_ALIGN):
            raise ValueError(f"{owner} row_align ({row_align!r}) must be 1 or {FP8_ROW_ALIGN}")
        self.row_align = row_align
        """16: where one rank holds every expert and nothing is dropped, lay each expert's
        tokens out at a multiple of 16 rows (the FP8 experts then copy nothing to pad)."""
        self.ep_group = check_group(ep_group, "ep_group", owner)
        self.etp_group = check_group(etp_group, "etp_group", owner)
        ep = group_size(ep_group)
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"{owner} num_experts ({num_experts!r}) must be a positive integer")
        if num_experts % ep:
            raise ValueError(
                f"num_experts ({num_experts}) is not divisible by ep ({ep}); "
                f"choose a multiple of {ep} experts or a smaller ep"
            )
        self.num_experts, self.ep = num_experts, ep
        self.num_local = num_experts // ep
        self.first_expert = group_rank(ep_group) * self.num_local
        self._counts_checked: set[int] = set()
        self.in_flight: Callable[[], object] | None = None
        """Run while the token all-to-alls are in flight (set by a caller that overlaps
        another micro-batch's compute with them, e.g. DualPipeV's pairs); None: nothing."""

    def _check_same_token_count(self, n: int, device: torch.device) -> None:
        """Padded chunks take their sizes from this rank's token count, so every ep and etp
        rank must route as many tokens: checked the first time a rank routes a count (a
        small all-gather and one host read), so that a mismatch on a count new to every
        rank is one sentence on every rank, not a hang. A rank that routes a count it has
        checked before skips the check (no host sync in the steady state), so a mismatch
        where some rank repeats a checked count is not caught: the token all-to-all then
        waits until the group's timeout."""
        if n in self._counts_checked:
            return
        for label, group in (("ep", self.ep_group), ("etp", self.etp_group)):
            if group_size(group) > 1:
                mine = torch.tensor([n], dtype=torch.long, device=device)
                counts = all_gather_no_grad(mine, group).flatten().tolist()
                if len(set(counts)) > 1:
                    raise ValueError(
                        f"pad_to_capacity needs every {label} rank to route the same number "
                        f"of tokens, but they route {counts}; give every rank micro-batches of "
                        "one shape, or turn pad_to_capacity off"
                    )
        self._counts_checked.add(n)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_experts={self.num_experts}, ep={self.ep}, "
            f"etp={group_size(self.etp_group)})"
        )


class AllToAllDispatcher(_Dispatcher):
    """Each rank sends each token to the ranks that hold its experts, with one all-to-all.

    The per-rank counts travel first (a small all-to-all, then one host sync for the split
    sizes). With ``pad_to_capacity`` every (rank, expert) chunk has exactly ``capacity``
    rows, so the sizes are known without either: that mode assumes every ep rank routes the
    same number of tokens (the same micro-batch shape), as a trainer's ranks do. ``during``
    runs while the token all-to-all is in flight (shared experts).
    """

    def dispatch(
        self, tokens: Tensor, routing: Routing, during: Callable[[], Tensor] | None = None
    ) -> Dispatched:
        """``[N, h]`` local tokens -> the local experts' rows (see :class:`Dispatched`)."""
        e, ep, local = self.num_experts, self.ep, self.num_local
        if routing.pad_to_capacity:
            assert routing.capacity is not None
            self._check_same_token_count(tokens.shape[0], tokens.device)
            perm = capacity_slots(routing.routing_map, routing.capacity)
            counts = torch.full((e,), routing.capacity, dtype=torch.long, device=tokens.device)
        etp_size = group_size(self.etp_group)
        alone = ep == 1 and etp_size == 1 and not routing.pad_to_capacity
        if not routing.pad_to_capacity:
            per_token = routing.top_k if routing.capacity is None else None
            align = self.row_align if alone and per_token is not None else 1
            perm, counts = sort_by_expert(routing.routing_map, per_token, align)  # counts [E]
        weights = perm.weights(routing.probs)  # [M_send]
        send = perm.gather(tokens)  # [N, h] -> [M_send, h] expert-major
        if alone:
            # one rank holds every expert: nothing travels, so the counts stay on the
            # device (the grouped GEMM takes its offsets from them): no host sync
            m = send.shape[0]
            side = during() if during is not None else None
            return Dispatched(send, counts, side, perm, weights, _EtpState([m], None, None),
                              ([m], [m]), aligned=align > 1)  # fmt: skip
        if routing.pad_to_capacity:
            # every chunk is exactly `capacity` rows (each rank routes as many tokens), so
            # the split sizes are known on the host: no count exchange, no host sync
            assert routing.capacity is not None
            cap = routing.capacity
            shape = (etp_size, ep, local)
            chunks = torch.full(shape, cap, dtype=torch.long, device=tokens.device)
            send_splits, chunk_host = [cap * local] * ep, [cap] * (etp_size * ep * local)
        else:
            recv = all_to_all_no_grad(counts.view(ep, local), self.ep_group)  # [ep, L] to me
            chunks = all_gather_no_grad(recv, self.etp_group)  # [etp, ep, L]
            host = torch.cat([counts.view(ep, local).sum(dim=1), chunks.flatten()]).tolist()
            send_splits, chunk_host = host[:ep], host[ep:]
        mine = group_rank(self.etp_group) * ep * local
        recv_splits = [
            sum(chunk_host[mine + p * local : mine + (p + 1) * local]) for p in range(ep)
        ]
        overlap = during is not None or self.in_flight is not None
        pending: list[dist.Work] | None = [] if overlap and ep > 1 else None
        received = all_to_all(send, recv_splits, send_splits, self.ep_group, pending)
        side = during() if during is not None else None
        if self.in_flight is not None:
            self.in_flight()
        for work in pending or []:
            work.wait()
        x, local_counts, etp = _to_experts(received, chunks, chunk_host, self.etp_group)
        return Dispatched(x, local_counts, side, perm, weights, etp, (send_splits, recv_splits))

    def combine(self, y: Tensor, dispatched: Dispatched) -> Tensor:
        """The experts' ``[M, h]`` output -> ``[N, h]``, weighted by the router's probs."""
        d = dispatched
        y = _from_experts(y, d.etp, self.etp_group)
        sent, received = d.splits
        pending: list[dist.Work] | None = [] if self.in_flight is not None else None
        y = all_to_all(y, sent, received, self.ep_group, pending)  # back to the senders
        if self.in_flight is not None:
            self.in_flight()
        for work in pending or []:
            work.wait()
        return d.perm.scatter_add(y, d.weights)  # [M_send, h] -> [N, h]


class AllGatherDispatcher(_Dispatcher):
    """Every rank all-gathers the tokens (and routing) of the ep group and computes the
    tokens routed to its own experts; the outputs are reduce-scattered back.

    Simple and good for small ep or few tokens; ``during`` runs after the gather.
    """

    def dispatch(
        self, tokens: Tensor, routing: Routing, during: Callable[[], Tensor] | None = None
    ) -> Dispatched:
        """``[N, h]`` local tokens -> the local experts' rows (see :class:`Dispatched`)."""
        first, local = self.first_expert, self.num_local
        sizes = all_gather_sizes(tokens.shape[0], self.ep_group, tokens.device)
        x_all = gather_rows(tokens, sizes, self.ep_group)  # [N, h] -> [N_ep, h]
        probs = gather_rows(routing.probs, sizes, self.ep_group)[:, first : first + local]
        routing_map = gather_rows_no_grad(routing.routing_map, sizes, self.ep_group)
        perm, counts = sort_by_expert(routing_map[:, first : first + local])
        weights = perm.weights(probs)
        send = perm.gather(x_all)  # [N_ep, h] -> [M, h] expert-major
        chunks = all_gather_no_grad(counts.view(1, local), self.etp_group)  # [etp, 1, L]
        chunk_host = chunks.flatten().tolist()
        side = during() if during is not None else None
        x, local_counts, etp = _to_experts(send, chunks, chunk_host, self.etp_group)
        return Dispatched(x, local_counts, side, perm, weights, etp, (sizes, sizes))

    def combine(self, y: Tensor, dispatched: Dispatched) -> Tensor:
        """The experts' ``[M, h]`` output -> ``[N, h]``, weighted by the router's probs."""
        d = dispatched
        y = _from_experts(y, d.etp, self.etp_group)
        out = d.perm.scatter_add(y, d.weights)  # [M, h] -> [N_ep, h], zero for other experts
        return reduce_scatter_rows(out, d.splits[0], self.ep_group)  # -> [N, h]
