"""The fp32 main-grad accumulation: ``main += alpha * grad`` once per parameter and micro-batch.

The data-parallel wrapper adds every parameter's gradient (bf16 under bf16 training) into its
fp32 ``main_grad`` after each micro-batch: 10 bytes an element moved, for every parameter,
every micro-batch (6 for the step's first, a copy). ATen's mixed-dtype ``add_`` does it in a
non-vectorised loop: on the H200 (2026-12-05) 38.7 ms of `deepseek-3b`'s 411 ms step at 4
micro-batches, ~3.1 TB/s of the GPU's 4.8. On CUDA, with Triton there, a contiguous pair goes
to one streaming kernel of the project's own (``_accumulate_triton``); anything else (CPU, a
strided view, a dtype the kernel does not take) to ATen.

Both compute the same fp32 value up to one rounding: ``main + alpha * float(grad)`` (the
kernel and ATen on CUDA may contract it into one fused multiply-add, or not).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

__all__ = ["accumulate_grad"]

_KERNEL_GRADS = (torch.bfloat16, torch.float16, torch.float32)


def accumulate_grad(main: Tensor, grad: Tensor, *, alpha: float = 1.0, first: bool = False) -> None:
    """``main += alpha * grad`` in ``main``'s dtype; ``first``: ``main`` holds nothing yet
    (its zeros are not read: ``main = alpha * grad``)."""
    if main.shape != grad.shape:
        raise ValueError(
            f"accumulate_grad: main {tuple(main.shape)} and grad {tuple(grad.shape)} must have "
            "the same shape"
        )
    if _kernel_applies(main, grad):
        from mega_zero_optim._accumulate_triton import accumulate

        accumulate(main, grad, alpha, first)
    elif first and alpha == 1.0:
        main.copy_(grad)
    elif first:
        main.copy_(grad).mul_(alpha)  # widening is exact: one rounding, as the add's
    else:
        main.add_(grad, alpha=alpha)


def _kernel_applies(main: Tensor, grad: Tensor) -> bool:
    return (
        _triton_enabled(main.device)
        and main.dtype == torch.float32
        and grad.dtype in _KERNEL_GRADS
        and grad.device == main.device
        and main.is_contiguous()
        and grad.is_contiguous()
        and main.numel() > 0
    )


def _triton_enabled(device: torch.device) -> bool:
    if device.type == "cpu":  # the interpreter runs CPU tensors, for the tests only
        return os.environ.get("TRITON_INTERPRET") == "1" and _has_triton()
    return device.type == "cuda" and _has_triton()


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None
