"""Weight gradients added straight into a data-parallel wrapper's fp32 ``main_grad``.

Under bf16 training a data-parallel wrapper (mega-zero-optim's ``DistributedDataParallel``)
keeps each parameter's gradient in an fp32 ``main_grad`` and, after every micro-batch, adds
the bf16 ``.grad`` autograd produced into it: the weight-gradient GEMM writes 2 bytes an
element and the add reads them back with the fp32 value. Megatron fuses the accumulation
into the GEMM (``gradient_accumulation_fusion``: cuBLAS reads and writes the fp32 buffer as
its C and D operands); so do the layers that opt in here: the linears built with
``wgrad_fusion=True`` and mega-moe's grouped experts.

The protocol between the packages, by parameter attribute (as ``main_grad`` itself):

- a layer that can accumulate a parameter's weight gradient itself, on every path its
  forward takes, marks the parameter ``mega_wgrad_fusion = True``
  (:data:`WGRAD_FUSION_ATTR`);
- a wrapper whose ``main_grad`` for that parameter is a persistent fp32 buffer, zeroed each
  step, sets ``mega_main_grad_alpha`` (:data:`MAIN_GRAD_ALPHA_ATTR`) to the factor it would
  scale the gradient by, and then does not add the ``.grad`` the layer hands autograd (an
  uninitialised tensor, there only so that the accumulator and its hooks run);
- the layer, seeing the attribute, adds ``alpha * dW`` into ``main_grad`` in its backward.

A weight used outside its layer's forward as well (an output head's weight read by the
loss) must not be marked: its other gradient would arrive through ``.grad`` and be dropped.

Inside backward a layer finds its main gradient by a key (:func:`register_wgrad_target`, a
host tensor), through a ``torch.library`` custom op, so compiled graphs keep it whole, never
take the main gradient as an input, and are shared by all layers.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function

__all__ = [
    "MAIN_GRAD_ALPHA_ATTR",
    "WGRAD_FUSION_ATTR",
    "addmm_into_main_grad",
    "fused_wgrad_key",
    "linear_into_main_grad",
    "linear_wgrad_into_main_grad",
    "main_grad_target",
    "placeholder_grad",
    "register_wgrad_target",
]

#: set to True by a layer on a parameter whose weight gradient it can accumulate itself
WGRAD_FUSION_ATTR = "mega_wgrad_fusion"
#: set by a data-parallel wrapper to the gradient's scale where the layer should accumulate
MAIN_GRAD_ALPHA_ATTR = "mega_main_grad_alpha"

#: key -> (the module, the weight's attribute name): where the ops find ``main_grad``
_TARGETS: dict[int, tuple[weakref.ref[nn.Module], str]] = {}
_NEXT_KEY = itertools.count()

_HALF = (torch.bfloat16, torch.float16)


def register_wgrad_target(module: nn.Module, name: str) -> Tensor:
    """A key under which the fused ops find ``getattr(module, name)``'s ``main_grad`` and
    scale (the module is held weakly).

    The key is a one-element int64 tensor on the host, not an int: a compiled graph takes
    a tensor as an input, so every layer shares one graph, where an int is a constant each
    layer's graph is compiled (and guarded) for, and past dynamo's recompile limit (8) the
    further layers ran uncompiled (``deepseek-3b``'s 11 MoE layers, until 2026-12-07). It
    is read on the host when the gradient is added: no device synchronisation.
    """
    key = next(_NEXT_KEY)
    _TARGETS[key] = (weakref.ref(module), name)
    return torch.tensor([key], dtype=torch.int64)


def main_grad_target(key: Tensor, weight: Tensor | None = None) -> tuple[Tensor, float]:
    """``(main_grad, alpha)`` of the weight registered under ``key``; one sentence where the
    wrapper's offer is gone, or where ``weight`` (the tensor the layer ran with) is not the
    registered one (a layer that took another's key)."""
    ref, name = _TARGETS[int(key.item())]
    module = ref()
    param = None if module is None else getattr(module, name, None)
    main = getattr(param, "main_grad", None)
    alpha = getattr(param, MAIN_GRAD_ALPHA_ATTR, None)
    if not isinstance(param, Tensor) or not isinstance(main, Tensor) or alpha is None:
        raise RuntimeError(
            f"the weight gradient of {name!r} was to go into its main_grad, but its module or "
            "the data-parallel wrapper's offer is gone; rebuild the wrapper before backward"
        )
    if weight is not None and weight.data_ptr() != param.data_ptr():
        raise RuntimeError(
            f"the weight gradient of {name!r} was to go into the main_grad registered under "
            "its key, which belongs to another layer's weight; give each layer its own key "
            "(register_wgrad_target)"
        )
    return main, float(alpha)


def fused_wgrad_key(weight: Tensor, key: Tensor | None) -> Tensor | None:
    """``key`` where a wrapper offered ``weight``'s fusion (:data:`MAIN_GRAD_ALPHA_ATTR`), else
    None: what a layer's forward passes on to its backward."""
    if key is None or getattr(weight, MAIN_GRAD_ALPHA_ATTR, None) is None:
        return None
    return key


def addmm_into_main_grad(main: Tensor, dy: Tensor, x: Tensor, alpha: float) -> None:
    """``main += alpha * dy^T @ x`` with ``main`` ``[N, K]`` fp32, ``dy`` ``[M, N]``, ``x``
    ``[M, K]`` of one dtype.

    On CUDA with bf16/fp16 operands one cuBLAS GEMM accumulates in fp32 and reads and writes
    ``main`` as its C and D (``torch.addmm(..., out_dtype=torch.float32)``, torch >= 2.8),
    after a one-time check on the device that this torch computes it so (else the product
    and one add). Elsewhere the product is taken in fp32 and added: the same sum, without
    rounding the product to the operands' dtype first.
    """
    if main.is_cuda and dy.dtype in _HALF and _out_dtype_addmm_works(main.device):
        torch.addmm(main, dy.t(), x, out_dtype=torch.float32, alpha=alpha, out=main)
    elif main.is_cuda and dy.dtype in _HALF:
        main.add_(dy.t() @ x, alpha=alpha)
    else:
        main.addmm_(dy.t().float(), x.float(), alpha=alpha)


@functools.cache
def _out_dtype_addmm_works(device: torch.device) -> bool:
    """Whether ``torch.addmm(c, a, b, out_dtype=float32, out=c)`` on ``device`` gives
    ``c + alpha * a @ b`` in fp32 for bf16 ``a`` (a transposed view, as in backward) and
    ``b``: integer data, so every product and sum is exact in fp32 and the check is equality;
    odd ``c`` near 4096 and products up to 24 * 64 need more bits than bf16 keeps, so a
    product or a result rounded to bf16 fails it."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-8, 9, (24, 40), generator=gen).to(device, torch.bfloat16)
    b = torch.randint(-8, 9, (24, 16), generator=gen).to(device, torch.bfloat16)
    c = 4096 + 2 * torch.randint(-512, 512, (40, 16), generator=gen) + 1
    c = c.to(device, torch.float32)
    want = c + 2.0 * (a.t().double() @ b.double()).float()
    try:
        torch.addmm(c, a.t(), b, out_dtype=torch.float32, alpha=2.0, out=c)
    except (RuntimeError, TypeError):
        return False
    return bool(torch.equal(c, want))


def placeholder_grad(weight: Tensor) -> Tensor:
    """What a fused layer hands autograd as ``weight``'s gradient: never read (the wrapper
    that offered the fusion drops it), so not written either; zeros under anomaly detection,
    which would flag the uninitialised memory's NaN bit patterns."""
    if torch.is_anomaly_enabled():
        return torch.zeros_like(weight)
    return torch.empty_like(weight)


@torch.library.custom_op("mega_tp_layers::linear_wgrad_into_main_grad", mutates_args=())
def _into_main_grad_op(dy: Tensor, x: Tensor, weight: Tensor, key: Tensor) -> Tensor:
    main, alpha = main_grad_target(key, weight)
    addmm_into_main_grad(main.view(dy.shape[1], x.shape[1]), dy, x, alpha)
    return placeholder_grad(weight)


@_into_main_grad_op.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, key: Tensor) -> Tensor:
    return torch.empty_like(weight)


def linear_wgrad_into_main_grad(grad: Tensor, inp: Tensor, weight: Tensor, key: Tensor) -> Tensor:
    """Add ``alpha * grad^T inp`` (``[.., out]``, ``[.., in]``, flattened over the leading
    dims) into the ``main_grad`` of the weight registered under ``key`` and return the
    uninitialised tensor that stands for ``weight``'s gradient.

    A custom op that declares no mutation: the main gradient is not an input of the graphs
    that call it, so the compiler never sees two views of the wrapper's one gradient buffer
    as aliased inputs mutated in backward. Its output is the weight's gradient, so it is
    never dropped as dead code.
    """
    grad_2d = grad.reshape(-1, grad.shape[-1]).contiguous()
    inp_2d = inp.reshape(-1, inp.shape[-1]).contiguous()
    out: Tensor = torch.ops.mega_tp_layers.linear_wgrad_into_main_grad(grad_2d, inp_2d, weight, key)
    return out


class _LinearIntoMainGrad(Function):
    """fwd: ``x W^T + b`` · bwd: input gradient, weight gradient added into ``main_grad``"""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, key: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.key = key
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad.matmul(weight) if need_x else None
        grad_w = linear_wgrad_into_main_grad(grad, x, weight, ctx.key) if need_w else None
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(dim=0) if need_b else None
        return grad_x, grad_w, grad_b, None


def linear_into_main_grad(x: Tensor, weight: Tensor, bias: Tensor | None, key: Tensor) -> Tensor:
    """``F.linear(x, weight, bias)`` whose weight gradient goes into ``weight.main_grad``
    (registered under ``key``, offered by the wrapper); the bias's goes through autograd."""
    out = _LinearIntoMainGrad.apply(x, weight, bias, key)
    assert isinstance(out, Tensor)
    return out
