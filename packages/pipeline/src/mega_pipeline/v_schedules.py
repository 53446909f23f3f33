"""The V schedules behind the common calling convention: ZBV and DualPipeV.

Each rank holds two model chunks in a V: chunk 0 is virtual stage ``pp_rank``, chunk 1
virtual stage ``2 pp - 1 - pp_rank`` (:func:`~mega_pipeline.zbv_stage`), so the first rank
both reads the input and computes the loss, and the last rank passes chunk 0's output to
its own chunk 1 without a message. The orders come from :mod:`mega_pipeline.zero_bubble`
and :mod:`mega_pipeline.dualpipe`, the exchanges from
:func:`~mega_pipeline.build_timed_plans` (all ranks' orders replayed together), and
:func:`~mega_pipeline.executor.run_plan` runs them; the gradients are those of plain
gradient accumulation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from torch import Tensor, nn

from mega_pipeline.chunk import DataIterator, ForwardStep, SplitBackward
from mega_pipeline.dualpipe import dualpipev_order, dualpipev_pairs
from mega_pipeline.executor import Hooks, run_plan
from mega_pipeline.order import Action
from mega_pipeline.p2p import P2PCommunicator
from mega_pipeline.schedules import _chunks, _iterators, _pp
from mega_pipeline.timed_plan import build_timed_plans
from mega_pipeline.zero_bubble import zbv_order

__all__ = ["forward_backward_dualpipev", "forward_backward_zbv"]

OrderFn = Callable[[int, int, int], list[Action]]
PairsFn = Callable[[int, int, int], list[int]]


def _run_v(
    name: str,
    order: OrderFn,
    *,
    forward_step: ForwardStep,
    data_iterator: DataIterator | Sequence[DataIterator],
    model: nn.Module | Sequence[nn.Module],
    num_microbatches: int,
    communicator: P2PCommunicator | None,
    forward_only: bool,
    hooks: Hooks,
    split_backward: SplitBackward | None,
    pairs: PairsFn | None = None,
    overlap: bool = False,
) -> list[dict[str, Tensor]]:
    chunks = _chunks(model)
    if len(chunks) != 2:
        raise ValueError(
            f"{name} runs two chunks per rank in a V, but the model has {len(chunks)}; pass "
            "this rank's chunks for virtual stages pp_rank and 2*pp-1-pp_rank"
        )
    pp, rank = _pp(communicator)
    if communicator is not None and communicator.variable_shapes:
        raise ValueError(
            f"{name} sends activations both ways, which needs a fixed tensor_shape; build "
            "the P2PCommunicator with tensor_shape instead of variable_shapes=True"
        )
    split = split_backward if not forward_only else None
    orders = []
    paired: list[set[Action]] = []
    for r in range(pp):
        actions = order(pp, r, num_microbatches)
        indices = pairs(pp, r, num_microbatches) if pairs is not None and not forward_only else []
        paired.append({actions[i] for i in indices})
        if forward_only:
            actions = [a for a in actions if a.kind == "F"]
        elif split is None:  # a fused backward: each B also computes the weight gradients
            actions = [a for a in actions if a.kind != "W"]
        orders.append(actions)
    plan = build_timed_plans(orders, 2, v_shape=True, pairs=paired)[rank]
    steps = [i for i, step in enumerate(plan) if step.action in paired[rank]]
    return run_plan(
        plan,
        forward_step=forward_step,
        chunks=chunks,
        data_iterators=_iterators(data_iterator, 2),
        communicator=communicator,
        pp=pp,
        pp_rank=rank,
        num_microbatches=num_microbatches,
        forward_only=forward_only,
        hooks=hooks,
        split_backward=split,
        v_shape=True,
        pairs=steps,
        overlap=overlap,
    )


def forward_backward_zbv(
    *,
    forward_step: ForwardStep,
    data_iterator: DataIterator | Sequence[DataIterator],
    model: nn.Module | Sequence[nn.Module],
    num_microbatches: int,
    communicator: P2PCommunicator | None = None,
    forward_only: bool = False,
    grad_sync_func: Callable[[int], None] | None = None,
    no_sync_func: Callable[[int], AbstractContextManager[Any]] | None = None,
    grad_scale_func: Callable[[Tensor], Tensor] | None = None,
    split_backward: SplitBackward | None = None,
) -> list[dict[str, Tensor]]:
    """ZBV (:func:`~mega_pipeline.zbv_order`): ``model`` is this rank's two V chunks.

    ``data_iterator`` is one iterator (or None) per chunk; the losses come back on rank 0,
    whose chunk 1 is the last virtual stage. ``split_backward`` as in
    :func:`~mega_pipeline.forward_backward_zb_h1` (without it each B is fused with its W).
    At most ``2 pp`` chunks' activations are in flight per rank. ``grad_sync_func(c)``
    fires after chunk ``c``'s last B and last W; ``no_sync_func`` wraps the others.
    """
    return _run_v(
        "forward_backward_zbv", zbv_order,
        forward_step=forward_step, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, communicator=communicator,
        forward_only=forward_only, hooks=Hooks(grad_sync_func, no_sync_func, grad_scale_func),
        split_backward=split_backward,
    )  # fmt: skip


def forward_backward_dualpipev(
    *,
    forward_step: ForwardStep,
    data_iterator: DataIterator | Sequence[DataIterator],
    model: nn.Module | Sequence[nn.Module],
    num_microbatches: int,
    communicator: P2PCommunicator | None = None,
    forward_only: bool = False,
    grad_sync_func: Callable[[int], None] | None = None,
    no_sync_func: Callable[[int], AbstractContextManager[Any]] | None = None,
    grad_scale_func: Callable[[Tensor], Tensor] | None = None,
    split_backward: SplitBackward | None = None,
    overlap: bool = True,
) -> list[dict[str, Tensor]]:
    """DualPipeV (:func:`~mega_pipeline.dualpipev_order`) on this rank's two V chunks.

    Arguments as in :func:`forward_backward_zbv`; ``num_microbatches`` must be at least
    ``2 pp``. Each overlapped pair (:func:`~mega_pipeline.dualpipev_pairs`) is one step:
    the receives of both micro-batches are posted first, then the compute, and both
    sends leave in the next exchange. With ``overlap`` and chunks that offer
    :class:`~mega_pipeline.OverlappedForwardBackward`, the compute is the chunk's
    overlapped call (e.g. one micro-batch's MoE all-to-all behind the other's layers);
    otherwise the forward, then the backward.
    """
    return _run_v(
        "forward_backward_dualpipev", dualpipev_order,
        forward_step=forward_step, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, communicator=communicator,
        forward_only=forward_only, hooks=Hooks(grad_sync_func, no_sync_func, grad_scale_func),
        split_backward=split_backward, pairs=dualpipev_pairs, overlap=overlap,
    )  # fmt: skip
