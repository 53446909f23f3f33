"""Free a stage's output once it has been sent, and run backward from the freed tensor.

After a stage sends its output to the next stage, it still needs the output's autograd
graph for backward, but not the output's values (unless an operation saved them, in which
case autograd keeps its own reference). Replacing the tensor's data by one element
broadcast to the same shape releases the storage while keeping ``grad_fn``, shape and
dtype, so ``torch.autograd.backward(output, grad)`` still runs unchanged.

A view cannot be freed that way: it keeps its base tensor, and so the storage, alive. Many
layers return views (``nn.Linear`` on a 3-D input reshapes a 2-D matrix product on some
torch versions), so a view is first replaced by a *viewless* alias: a new tensor on the
same storage with no link to the base, whose backward is the identity. Once the caller
drops the view, freeing the alias releases the storage.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd import Function

__all__ = ["backward_from", "deallocate_output", "is_deallocated", "make_viewless"]


class _MakeViewless(Function):
    """fwd: viewless alias (same storage, no link to a base) · bwd: identity"""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.detach()  # shares x's storage; a detached tensor has no _base

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


def make_viewless(output: Tensor) -> Tensor:
    """``output`` itself, or for a view an alias of its storage that is not a view.

    The alias carries the same values and passes gradients to ``output`` unchanged; unlike
    the view, it does not keep the base tensor alive.
    """
    if output._base is None:
        return output
    alias = _MakeViewless.apply(output)
    assert isinstance(alias, Tensor) and alias._base is None
    return alias


def deallocate_output(output: Tensor) -> Tensor:
    """Release ``output``'s storage; return the tensor to keep for backward in its place.

    The returned tensor is ``output`` itself, or a viewless alias when ``output`` is a view
    (see :func:`make_viewless`); either way it keeps the graph, shape and dtype, holds one
    element of storage, and backward from it gives the gradients ``output`` would. Drop
    every other reference to ``output``: a view still held elsewhere keeps its base's
    storage alive. Tensors of at most one element are returned as they are.
    """
    if output.numel() <= 1:
        return output
    kept = make_viewless(output)
    placeholder = torch.empty((1,), dtype=kept.dtype, device=kept.device)
    kept.data = placeholder.expand(kept.shape)
    return kept


def is_deallocated(output: Tensor) -> bool:
    """True when ``output`` holds one element of storage for a larger shape."""
    return output.numel() > 1 and output.untyped_storage().nbytes() <= output.element_size()


def backward_from(output: Tensor, grad: Tensor | None) -> None:
    """Backpropagate ``grad`` (None: ``output`` is a scalar loss) from a maybe-freed output."""
    if grad is None:
        torch.autograd.backward(output)
    else:
        torch.autograd.backward(output, grad_tensors=grad)
