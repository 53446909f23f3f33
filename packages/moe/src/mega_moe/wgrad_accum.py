"""Expert weight gradients accumulated straight into the data-parallel wrapper's fp32 buffer.

Under bf16 training a data-parallel wrapper (mega-zero-optim's ``DistributedDataParallel``)
keeps each parameter's gradient in an fp32 ``main_grad`` and, after every micro-batch, adds
the bf16 ``.grad`` autograd produced into it: 12 bytes an element moved, every micro-batch.
The experts hold most of a fine-grained MoE's parameters and see few tokens each, so that
pass costs as much as their weight-gradient GEMMs (``deepseek-3b``: 3.0 of its 3.4 B
parameters, ~770 tokens an expert per 8k-token micro-batch). Megatron fuses the
accumulation into the GEMM (``gradient_accumulation_fusion``); so does this module.

The protocol between the packages (a parameter attribute the layer sets, one the wrapper
answers with, and a key under which backward finds ``main_grad``) is
``mega_tp_layers.main_grad_fusion``'s, re-exported here; :class:`GroupedMLP` marks its
two weights.

:func:`grouped_wgrad_accumulate` is the accumulation: a Triton kernel of the project's own
on CUDA (``mega_moe._wgrad_triton``), ``torch._grouped_mm`` or a loop of GEMMs and one add
elsewhere. Inside backward the layer calls :func:`wgrad_into_main_grad`, a ``torch.library``
custom op that finds the main gradient by a key (a host tensor), so compiled graphs keep it
whole, never take the main gradient as an input, and are shared by all layers.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

from mega_tp_layers.main_grad_fusion import (
    MAIN_GRAD_ALPHA_ATTR,
    WGRAD_FUSION_ATTR,
    main_grad_target,
    placeholder_grad,
    register_wgrad_target,
)

__all__ = [
    "MAIN_GRAD_ALPHA_ATTR",
    "WGRAD_FUSION_ATTR",
    "grouped_wgrad_accumulate",
    "main_grad_target",
    "register_wgrad_target",
    "wgrad_into_main_grad",
]

_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def _accumulate(
    main: Tensor, dy: Tensor, x: Tensor, ends: Tensor, alpha: float, use_grouped_mm: bool
) -> None:
    if _kernel_applies(main, dy, x):
        from mega_moe._wgrad_triton import grouped_wgrad_accumulate_kernel

        grouped_wgrad_accumulate_kernel(main, dy, x, ends, alpha)
        return
    main.add_(_wgrad(dy, x, ends, use_grouped_mm), alpha=alpha)


@torch.library.custom_op("mega_moe::wgrad_into_main_grad", mutates_args=())
def _into_main_grad_op(
    dy: Tensor, x: Tensor, ends: Tensor, weight: Tensor, key: Tensor, use_grouped_mm: bool
) -> Tensor:
    main, alpha = main_grad_target(key)
    experts = main.shape[0]
    _accumulate(main.view(experts, dy.shape[1], x.shape[1]), dy, x, ends, alpha, use_grouped_mm)
    return placeholder_grad(weight)


@_into_main_grad_op.register_fake
def _(
    dy: Tensor, x: Tensor, ends: Tensor, weight: Tensor, key: Tensor, use_grouped_mm: bool
) -> Tensor:
    return torch.empty_like(weight)


def wgrad_into_main_grad(
    dy: Tensor, x: Tensor, ends: Tensor, weight: Tensor, key: Tensor, use_grouped_mm: bool
) -> Tensor:
    """Add ``alpha * dy_l^T x_l`` into the ``main_grad`` of the weight registered under
    ``key`` (:func:`register_wgrad_target`; ``alpha`` its wrapper's scale) and return the
    uninitialised tensor that stands for ``weight``'s gradient.

    A custom op that declares no mutation: the main gradient is not an input of the graphs
    that call it, so the compiler never sees two views of the wrapper's one gradient buffer
    as aliased inputs mutated in backward (which gave wrong sums on the GPU under Inductor,
    2026-12-06). Its output is the weight's gradient, so it is never dropped as dead code.
    """
    out: Tensor = torch.ops.mega_moe.wgrad_into_main_grad(
        dy.contiguous(), x.contiguous(), ends.to(torch.int32), weight, key, use_grouped_mm
    )
    return out


def _wgrad(dy: Tensor, x: Tensor, ends: Tensor, use_grouped_mm: bool) -> Tensor:
    """``[L, N, K]``: ``dy_l^T @ x_l`` over each expert's rows (the grouped GEMM's in the
    inputs' dtype, the loop's in fp32)."""
    if use_grouped_mm:
        out: Tensor = torch._grouped_mm(dy.t(), x, offs=ends)
        return out
    starts = [0, *ends.tolist()[:-1]]
    # in fp32, as the kernel: the loop runs where speed matters little (CPU, no grouped GEMM)
    return torch.stack(
        [dy[a:b].t().float() @ x[a:b].float() for a, b in zip(starts, ends.tolist(), strict=True)]
    )


def grouped_wgrad_accumulate(
    main: Tensor,
    dy: Tensor,
    x: Tensor,
    ends: Tensor,
    alpha: float = 1.0,
    *,
    use_grouped_mm: bool = False,
) -> None:
    """``main[l] += alpha * dy[rows of l]^T @ x[rows of l]`` for every expert ``l``.

    ``main`` is ``[L, N, K]`` fp32, ``dy`` ``[M, N]`` and ``x`` ``[M, K]`` of one dtype with
    each expert's rows contiguous, ``ends`` the ``[L]`` int32 end row of each expert's block
    (on the device). An expert with no rows adds nothing. Without the kernel (CPU, fp32
    inputs) the products are ``torch._grouped_mm``'s where ``use_grouped_mm`` (the caller
    checked it runs: :func:`mega_moe._gemm.grouped_mm_available`), else a loop of GEMMs.
    """
    experts = main.shape[0]
    if (
        main.dim() != 3
        or dy.dim() != 2
        or x.dim() != 2
        or main.shape[1:] != (dy.shape[1], x.shape[1])
        or dy.shape[0] != x.shape[0]
        or ends.shape != (experts,)
    ):
        raise ValueError(
            f"grouped_wgrad_accumulate: main {tuple(main.shape)} must be [L, N, K] for dy "
            f"{tuple(dy.shape)} = [M, N], x {tuple(x.shape)} = [M, K] and ends "
            f"{tuple(ends.shape)} = [L]"
        )
    if main.dtype != torch.float32 or dy.dtype != x.dtype:
        raise ValueError(
            f"grouped_wgrad_accumulate: main must be float32 (got {main.dtype}) and dy, x of "
            f"one dtype (got {dy.dtype}, {x.dtype})"
        )
    _accumulate(
        main, dy.contiguous(), x.contiguous(), ends.to(torch.int32), float(alpha), use_grouped_mm
    )


def _kernel_applies(main: Tensor, dy: Tensor, x: Tensor) -> bool:
    return (
        _triton_enabled(main.device)
        and dy.dtype in _KERNEL_DTYPES
        and x.dtype == dy.dtype
        and main.stride(2) == 1
        and dy.stride(1) == 1
        and x.stride(1) == 1
        and dy.shape[0] > 0
    )


def _triton_enabled(device: torch.device) -> bool:
    if device.type == "cpu":  # the interpreter runs CPU tensors, for the tests only
        return os.environ.get("TRITON_INTERPRET") == "1" and _has_triton()
    return device.type == "cuda" and _has_triton()


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None
