"""The hook through which a model chunk overlaps one micro-batch's forward with another's backward.

DualPipeV runs its ``F&B`` pairs (:func:`~mega_pipeline.dualpipev_pairs`) as one compute
step. When every chunk offers :class:`OverlappedForwardBackward`, the schedule

1. enters :meth:`~OverlappedForwardBackward.overlap_record` around the forward of every
   micro-batch whose backward belongs to a pair, and keeps what it yields;
2. at a pair, calls :meth:`~OverlappedForwardBackward.overlapped_forward_backward` on the
   forward's chunk with a thunk that runs that forward (``forward_step`` on the chunk),
   the record of the backward's micro-batch and the backward's output and output gradient.

The chunk interleaves the two as it likes (layer by layer; with MoE, one micro-batch's
all-to-all in flight while the other computes). A chunk without the hook runs the pair's
forward, then its backward. The package stays model-agnostic: it never looks inside.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar, runtime_checkable

from torch import Tensor

__all__ = ["OverlappedForwardBackward"]

T = TypeVar("T")


@runtime_checkable
class OverlappedForwardBackward(Protocol):
    """A chunk module that runs a forward and a backward of two micro-batches as one step."""

    def overlap_record(self) -> AbstractContextManager[Any]:
        """Entered around a forward whose backward will run in a pair; yields the record
        (opaque to the schedule) that :meth:`overlapped_forward_backward` gets back. The
        chunk keeps in it what a piecewise backward needs (e.g. each layer's input)."""

    def overlapped_forward_backward(
        self,
        forward: Callable[[], T],
        record: Any,
        outputs: Tensor,
        output_grads: Tensor | None,
    ) -> T:
        """Run ``forward()`` (one micro-batch through this chunk) with the backward of
        another micro-batch interleaved; return what ``forward()`` returned.

        ``record`` is what :meth:`overlap_record` yielded around the backward
        micro-batch's forward, on this chunk or on another chunk of the same rank.
        ``outputs`` is that forward's output (on the last stage the scaled loss) and
        ``output_grads`` the gradient arriving at it (``None`` for a loss). When the
        call returns, the backward is complete: the parameters' gradients accumulated
        (or left for the W pass under a split backward) and the backward's input
        gradient in ``.grad`` of its input tensor, as a plain backward leaves them.
        """
