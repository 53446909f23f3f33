"""Free a stage's output once it has been sent, and run backward from the freed tensor.

After a stage sends its output to the next stage, it still needs the output's autograd
graph for backward, but not the output's values (unless the last operation saved them,
in which case autograd keeps its own reference). Replacing the tensor's data by one
element broadcast to the same shape releases the storage while keeping ``grad_fn``,
shape and dtype, so ``torch.autograd.backward(output, grad)`` still runs unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["backward_from", "deallocate_output", "is_deallocated"]


def deallocate_output(output: Tensor) -> None:
    """Release ``output``'s storage, keeping its graph, shape and dtype; views are left as is.

    A view shares its base's storage, so freeing it would release nothing.
    """
    if output._base is not None or output.numel() <= 1:
        return
    placeholder = torch.empty((1,), dtype=output.dtype, device=output.device)
    output.data = placeholder.expand(output.shape)


def is_deallocated(output: Tensor) -> bool:
    """True when ``output`` holds one element of storage for a larger shape."""
    return output.numel() > 1 and output.untyped_storage().nbytes() <= output.element_size()


def backward_from(output: Tensor, grad: Tensor | None) -> None:
    """Backpropagate ``grad`` (None: ``output`` is a scalar loss) from a maybe-freed output."""
    if grad is None:
        torch.autograd.backward(output)
    else:
        torch.autograd.backward(output, grad_tensors=grad)
