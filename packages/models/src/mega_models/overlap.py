"""DualPipeV's overlapped pairs inside a model chunk: one micro-batch's forward interleaved
with another's backward, layer by layer, MoE all-to-alls in flight behind compute.

A chunk offers mega-pipeline's ``OverlappedForwardBackward`` through :class:`OverlappedStage`:

- ``overlap_record()``, around the forward of a micro-batch whose backward will be paired:
  each layer's input is kept and the layer is fed a detached copy that requires grad, so
  the backward can later run one layer at a time
  (``torch.autograd.backward(layer_output, grad)``, the grad read off the next layer's
  detached input);
- ``overlapped_forward_backward(forward, record, outputs, grads)``: runs ``forward()``
  (this chunk's forward of another micro-batch); before each of its layers, one backward
  piece of the recorded micro-batch runs; in an MoE layer, the token dispatch and combine
  all-to-alls are issued asynchronously and one backward piece runs before they are
  waited for (on NCCL the collective runs on NCCL's stream meanwhile; on gloo in its
  threads). What is left of the backward runs when the forward returns.

Each backward piece accumulates its layer's gradients as a plain backward would (DDP hooks
fire once per parameter, under a split backward the weight gradients still wait for W),
and the recorded micro-batch's input gradient ends in its input tensor's ``.grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

__all__ = ["OverlapRecord", "OverlappedStage", "overlap_boundary"]

T = TypeVar("T")


class OverlapRecord:
    """A recorded forward's layer boundaries: (input as computed, detached input fed on)."""

    def __init__(self) -> None:
        self.boundaries: list[tuple[Tensor, Tensor]] = []


class _Backward:
    """A recorded micro-batch's backward, cut into pieces: the head and last layer, then one
    layer at a time, last the chunk's input (the embedding, or the received activation)."""

    def __init__(self, record: OverlapRecord, outputs: Tensor, grads: Tensor | None) -> None:
        self._pieces = self._run(record, outputs, grads)

    @staticmethod
    def _run(record: OverlapRecord, outputs: Tensor, grads: Tensor | None) -> Iterator[None]:
        torch.autograd.backward(outputs, grads)
        yield
        while record.boundaries:
            computed, fed = record.boundaries.pop()
            grad = fed.grad if fed.grad is not None else torch.zeros_like(fed)
            fed.grad = None
            torch.autograd.backward(computed, grad)
            yield

    def step(self) -> None:
        """Run the next piece, if one is left."""
        next(self._pieces, None)

    def finish(self) -> None:
        """Run every piece left."""
        for _ in self._pieces:
            pass


def overlap_boundary(model: nn.Module, hidden: Tensor) -> Tensor:
    """Called before each layer of a chunk's forward: runs a backward piece of the paired
    micro-batch (in an overlapped call) and, when recording, returns the layer's detached
    input."""
    backward: _Backward | None = getattr(model, "_overlap_backward", None)
    if backward is not None:
        backward.step()
    record: OverlapRecord | None = getattr(model, "_overlap_record", None)
    if record is None or not hidden.requires_grad:
        return hidden
    fed = hidden.detach().requires_grad_()
    record.boundaries.append((hidden, fed))
    return fed


def _dispatchers(model: nn.Module) -> list[Any]:
    """The MoE token dispatchers of the chunk's layers (those with ``in_flight``)."""
    found = []
    for module in model.modules():
        dispatcher = getattr(module, "dispatcher", None)
        if dispatcher is not None and hasattr(dispatcher, "in_flight"):
            found.append(dispatcher)
    return found


class OverlappedStage:
    """Mixin for model chunks whose forward runs its layers through
    :func:`~mega_models.stage_body.run_stage`: mega-pipeline's ``OverlappedForwardBackward``."""

    overlap_pairs: bool = True
    """False: a pair's forward runs whole, then its backward (the trainer's
    ``parallel.dualpipev_overlap false``)."""
    _overlap_record: OverlapRecord | None = None
    _overlap_backward: _Backward | None = None

    @contextmanager
    def overlap_record(self) -> Iterator[OverlapRecord]:
        """Around a forward whose backward will be overlapped: keeps its layer boundaries."""
        assert self._overlap_record is None, "overlap records do not nest"
        record = OverlapRecord()
        self._overlap_record = record
        try:
            yield record
        finally:
            self._overlap_record = None

    def overlapped_forward_backward(
        self,
        forward: Callable[[], T],
        record: OverlapRecord,
        outputs: Tensor,
        output_grads: Tensor | None,
    ) -> T:
        """``forward()`` with the backward of ``record``'s micro-batch interleaved."""
        assert isinstance(self, nn.Module)
        assert self._overlap_backward is None, "overlapped pairs do not nest"
        backward = _Backward(record, outputs, output_grads)
        if not self.overlap_pairs:
            result = forward()
            backward.finish()
            return result
        dispatchers = _dispatchers(self)
        self._overlap_backward = backward
        for dispatcher in dispatchers:
            dispatcher.in_flight = backward.step
        try:
            result = forward()
        finally:
            self._overlap_backward = None
            for dispatcher in dispatchers:
                dispatcher.in_flight = None
        backward.finish()
        return result
