"""The forward-backward schedules: no pipelining, 1F1B and interleaved 1F1B, one convention.

Each computes the per-rank order (:mod:`mega_pipeline.order`), the exchanges around it
(:mod:`mega_pipeline.plan`) and runs them (:mod:`mega_pipeline.executor`). Every schedule
gives the gradients of plain gradient accumulation: each microbatch's loss is divided by
``num_microbatches`` before its backward, so gradients are the mean over microbatches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, cast

from torch import Tensor, nn

from mega_pipeline.chunk import DataIterator, ForwardStep, SplitBackward
from mega_pipeline.executor import Hooks, run_plan
from mega_pipeline.order import (
    Action,
    interleaved_order,
    interleaved_warmup,
    no_pipelining_order,
    one_f_one_b_order,
)
from mega_pipeline.p2p import P2PCommunicator
from mega_pipeline.plan import build_plan
from mega_pipeline.zero_bubble import zb_h1_order

__all__ = [
    "ForwardBackwardFunc",
    "forward_backward_1f1b",
    "forward_backward_interleaved",
    "forward_backward_no_pipelining",
    "forward_backward_zb_h1",
    "get_forward_backward_func",
]


class ForwardBackwardFunc(Protocol):
    """The signature the three schedules share."""

    def __call__(
        self,
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
    ) -> list[dict[str, Tensor]]: ...


def _chunks(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
        raise TypeError("model must be an nn.Module or a non-empty list of nn.Module chunks")
    return chunks


def _iterators(data_iterator: DataIterator | Sequence[DataIterator], n: int) -> list[DataIterator]:
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != n:
            raise ValueError(
                f"data_iterator is a list of {len(data_iterator)}, but the model has {n} "
                "chunks on this rank; pass one iterator (or None) per chunk"
            )
        return list(data_iterator)
    if n != 1:
        raise ValueError(
            f"the model has {n} chunks on this rank but a single data_iterator was given; "
            f"pass a list of {n} iterators (or None), one per chunk"
        )
    return [cast(DataIterator, data_iterator)]


def _pp(communicator: P2PCommunicator | None) -> tuple[int, int]:
    if communicator is None:
        return 1, 0
    if not isinstance(communicator, P2PCommunicator):
        raise TypeError(
            f"communicator must be a P2PCommunicator, not {type(communicator).__name__}"
        )
    return communicator.size, communicator.rank


def forward_backward_no_pipelining(
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
) -> list[dict[str, Tensor]]:
    """Plain gradient accumulation over ``num_microbatches`` on one stage.

    Returns one dict per microbatch (``"loss"`` and whatever ``loss_func`` logged). With
    ``no_sync_func``, every backward but the last runs inside ``no_sync_func(0)``;
    ``grad_sync_func(0)`` is called after the last backward.
    """
    chunks = _chunks(model)
    pp, _ = _pp(communicator)
    if pp != 1 or len(chunks) != 1:
        raise ValueError(
            f"forward_backward_no_pipelining runs one stage with one chunk, but pp is {pp} "
            f"and the model has {len(chunks)} chunks; use get_forward_backward_func(pp, vpp)"
        )
    actions = no_pipelining_order(num_microbatches, forward_only)
    return run_plan(
        build_plan(actions, 1, 1, 0),
        forward_step=forward_step,
        chunks=chunks,
        data_iterators=_iterators(data_iterator, 1),
        communicator=communicator,
        pp=1,
        pp_rank=0,
        num_microbatches=num_microbatches,
        forward_only=forward_only,
        hooks=Hooks(grad_sync_func, no_sync_func, grad_scale_func),
    )


def forward_backward_1f1b(
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
) -> list[dict[str, Tensor]]:
    """1F1B over the pp group of ``communicator``: warmup, one forward one backward, cooldown.

    Stage ``r`` holds at most ``pp - r`` microbatches of activations; the losses come
    back on the last stage (an empty list elsewhere). Hooks as in
    :func:`forward_backward_no_pipelining`.
    """
    return _run_one_chunk(
        "forward_backward_1f1b",
        "use forward_backward_interleaved for virtual pipeline chunks",
        lambda pp, rank: one_f_one_b_order(pp, rank, num_microbatches, forward_only),
        forward_step=forward_step,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        communicator=communicator,
        forward_only=forward_only,
        hooks=Hooks(grad_sync_func, no_sync_func, grad_scale_func),
    )


def _run_one_chunk(
    name: str,
    way_out: str,
    order: Callable[[int, int], list[Action]],
    *,
    forward_step: ForwardStep,
    data_iterator: DataIterator | Sequence[DataIterator],
    model: nn.Module | Sequence[nn.Module],
    num_microbatches: int,
    communicator: P2PCommunicator | None,
    forward_only: bool,
    hooks: Hooks,
    split_backward: SplitBackward | None = None,
) -> list[dict[str, Tensor]]:
    """Run schedule ``name`` on this rank's single chunk: ``order(pp, rank)`` its actions."""
    chunks = _chunks(model)
    if len(chunks) != 1:
        raise ValueError(
            f"{name} runs one chunk per rank, but the model has {len(chunks)}; {way_out}"
        )
    pp, rank = _pp(communicator)
    return run_plan(
        build_plan(order(pp, rank), pp, 1, rank),
        forward_step=forward_step,
        chunks=chunks,
        data_iterators=_iterators(data_iterator, 1),
        communicator=communicator,
        pp=pp,
        pp_rank=rank,
        num_microbatches=num_microbatches,
        forward_only=forward_only,
        hooks=hooks,
        split_backward=split_backward,
    )


def forward_backward_interleaved(
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
) -> list[dict[str, Tensor]]:
    """Interleaved 1F1B: ``model`` is this rank's ``vpp`` chunks, chunk ``c`` being virtual
    stage ``c * pp + rank``; ``data_iterator`` is one iterator (or None) per chunk.

    The bubble shrinks to ``(pp - 1) / (vpp * m)`` of the ideal time. ``num_microbatches``
    must be a multiple of ``pp``. ``grad_sync_func(c)`` fires right after chunk ``c``'s
    last backward, so its gradient reduction overlaps the other chunks' backward.
    """
    chunks = _chunks(model)
    vpp = len(chunks)
    pp, rank = _pp(communicator)
    if pp == 1 and vpp > 1:
        raise ValueError(
            f"vpp ({vpp}) needs pipeline parallelism, but pp is 1; set pp > 1 or pass one chunk"
        )
    actions = interleaved_order(pp, vpp, rank, num_microbatches, forward_only)
    pair_from = None if forward_only else interleaved_warmup(pp, vpp, rank, num_microbatches)
    return run_plan(
        build_plan(actions, pp, vpp, rank, pair_from=pair_from),
        forward_step=forward_step,
        chunks=chunks,
        data_iterators=_iterators(data_iterator, vpp),
        communicator=communicator,
        pp=pp,
        pp_rank=rank,
        num_microbatches=num_microbatches,
        forward_only=forward_only,
        hooks=Hooks(grad_sync_func, no_sync_func, grad_scale_func),
    )


def forward_backward_zb_h1(
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
    """ZB-H1 (:func:`~mega_pipeline.zb_h1_order`): 1F1B whose backward is split into B and W.

    ``split_backward`` (e.g. ``mega_tp_layers.defer_weight_grads``) is entered around every
    forward; each W action runs what it yielded, the weight gradients of the layers that
    split their backward (the others' came in B). Without it the backward stays fused and
    the order is 1F1B's. At most ``pp`` microbatches are in flight per rank; with equal F,
    B and W times the bubble is ``pp - 1`` of them against 1F1B's ``3 (pp - 1)``.
    Hooks as in :func:`forward_backward_no_pipelining`; ``grad_sync_func`` fires after
    the chunk's last W.
    """
    split = split_backward if not forward_only else None

    def order(pp: int, rank: int) -> list[Action]:
        if split is None:
            return one_f_one_b_order(pp, rank, num_microbatches, forward_only)
        return zb_h1_order(pp, rank, num_microbatches)

    return _run_one_chunk(
        "forward_backward_zb_h1",
        "pass this rank's single chunk",
        order,
        forward_step=forward_step,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        communicator=communicator,
        forward_only=forward_only,
        hooks=Hooks(grad_sync_func, no_sync_func, grad_scale_func),
        split_backward=split,
    )


def get_forward_backward_func(pp_size: int, vpp_size: int | None = None) -> ForwardBackwardFunc:
    """The schedule for a layout: no pipelining for pp 1, 1F1B, or interleaved for vpp > 1."""
    if not isinstance(pp_size, int) or pp_size < 1:
        raise ValueError(f"pp_size ({pp_size!r}) must be a positive integer")
    if vpp_size is not None and (not isinstance(vpp_size, int) or vpp_size < 1):
        raise ValueError(
            f"vpp_size ({vpp_size!r}) must be a positive integer, or None for no interleaving"
        )
    if vpp_size is not None and vpp_size > 1:
        if pp_size == 1:
            raise ValueError(
                f"vpp ({vpp_size}) needs pipeline parallelism, but pp is 1; "
                "set pp > 1 or leave vpp unset"
            )
        return forward_backward_interleaved
    return forward_backward_no_pipelining if pp_size == 1 else forward_backward_1f1b
