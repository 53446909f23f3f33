"""One GEMM per expert over contiguous row blocks: ``torch._grouped_mm`` or a loop.

``torch._grouped_mm`` exists from torch 2.8 (CUDA, bf16, sm80+); its CPU kernel from 2.9.
Both need 16-byte aligned strides and data pointers. Where it cannot run, the same
product is computed by a loop of ``F.linear`` over the experts' row blocks.

:func:`split_grouped_linear` is the same product whose backward is split for zero-bubble
pipelines: the input gradient (one grouped GEMM against the weights) in B, the weight
gradient (one grouped GEMM ``dy_l^T x_l`` per expert block) left in a
:class:`mega_tp_layers.WeightGradStore` for the W pass.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function
from torch.torch_version import TorchVersion

from mega_moe.wgrad_accum import wgrad_into_main_grad
from mega_tp_layers import WeightGradStore

__all__ = ["expert_activation", "grouped_linear", "grouped_mm_available", "split_grouped_linear"]


def _aligned(t: Tensor, *dims: int) -> bool:
    size = t.element_size()
    if not all(d * size % 16 == 0 for d in dims):
        return False
    # under torch.compile the pointer cannot be read; the compiler lays out what it makes
    # (the tokens and activations are fresh tensors here, the weights whole parameters)
    return torch.compiler.is_compiling() or t.data_ptr() % 16 == 0


#: torch's CPU grouped GEMM came with 2.9. Read once here: Dynamo in torch 2.11 cannot
#: trace ``TorchVersion`` (a str subclass), and under ``fullgraph`` the check inside the
#: layer failed the compile on CPU
_CPU_GROUPED_MM = TorchVersion(torch.__version__) >= "2.9"


def _shape_function_takes_fp32() -> bool:
    """Whether this torch's shape function of ``torch._grouped_mm`` accepts fp32 operands.

    ``torch.compile`` traces the op through it: torch 2.11's demands bf16 on any device, so
    a compiled fp32 layer on CPU failed there while the eager CPU kernel takes fp32 (newer
    torch accepts both). Meta tensors only: no device, nothing computed; read at import.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    x, w = torch.empty(16, 16, device="meta"), torch.empty(1, 16, 16, device="meta")
    try:
        torch._grouped_mm(
            x, w.transpose(1, 2), offs=torch.empty(1, dtype=torch.int32, device="meta")
        )
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return True


_COMPILED_FP32_GROUPED_MM = _shape_function_takes_fp32()


def grouped_mm_available(x: Tensor, *weights: Tensor) -> bool:
    """True when ``torch._grouped_mm`` runs here for ``x [M, in]`` and ``[L, out, in]`` weights."""
    if not hasattr(torch, "_grouped_mm") or x.shape[0] == 0:
        return False
    if x.device.type == "cuda":
        capability = torch.cuda.get_device_capability(x.device)
        if x.dtype != torch.bfloat16 or capability < (8, 0):
            return False
    elif x.device.type == "cpu":
        if x.dtype not in (torch.float32, torch.bfloat16):
            return False
        if not _CPU_GROUPED_MM:
            return False
        if x.dtype == torch.float32 and torch.compiler.is_compiling():
            if not _COMPILED_FP32_GROUPED_MM:
                return False  # the loop of GEMMs instead (see _shape_function_takes_fp32)
    else:
        return False
    if any(w.dtype != x.dtype for w in weights) or not x.is_contiguous():
        return False
    return _aligned(x, x.shape[1]) and all(
        w.is_contiguous() and _aligned(w, w.shape[1], w.shape[2]) for w in weights
    )


def _contiguous(grad: Tensor) -> Tensor:
    return grad.contiguous()


def _offsets(counts: list[int] | Tensor, device: torch.device) -> Tensor:
    """The int32 end row of each expert's block, on ``device``.

    Device counts give them with a cumulative sum (no host sync, nothing for the compiler
    to break on). Host counts are copied up; eagerly on a GPU through pinned memory without
    blocking (a copy from pageable memory would synchronise the stream every call), under
    ``torch.compile`` as a plain tensor (the compiler cannot trace pinning).
    """
    if isinstance(counts, Tensor):
        return torch.cumsum(counts, 0).to(torch.int32)
    ends = list(accumulate(counts))
    if device.type == "cuda" and not torch.compiler.is_compiling():
        host = torch.tensor(ends, dtype=torch.int32)
        return host.pin_memory().to(device, non_blocking=True)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def grouped_linear(
    x: Tensor, weight: Tensor, counts: list[int] | Tensor, use_grouped_mm: bool
) -> Tensor:
    """``[M, in] -> [M, out]``: rows of expert l (``counts[l]`` of them) times ``weight[l].T``.

    ``weight`` is ``[L, out, in]`` (the nn.Linear layout per expert); ``counts`` on the host
    or ``[L]`` on the device (read on the host only by the loop).
    """
    if use_grouped_mm:
        offs = _offsets(counts, x.device)
        out: Tensor = torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)
        if out.requires_grad:
            out.register_hook(_contiguous)  # type: ignore[no-untyped-call]  # dense grads
        return out
    sizes = counts.tolist() if isinstance(counts, Tensor) else counts
    blocks = torch.split(x, sizes)
    return torch.cat([F.linear(block, weight[e]) for e, block in enumerate(blocks)])


def _grouped_wgrad(
    grad: Tensor, x: Tensor, counts: list[int] | Tensor, use_grouped_mm: bool, experts: int
) -> Tensor:
    """``[L, out, in]``: ``grad_l^T @ x_l`` over each expert's rows (zeros for an empty one)."""
    if use_grouped_mm:
        out: Tensor = torch._grouped_mm(grad.t(), x, offs=_offsets(counts, x.device))
        return out
    sizes = counts.tolist() if isinstance(counts, Tensor) else counts
    pairs = zip(torch.split(grad, sizes), torch.split(x, sizes), strict=True)
    blocks = [g.t().matmul(block) for g, block in pairs]
    assert len(blocks) == experts
    return torch.stack(blocks)


class _SplitGroupedLinear(Function):
    """fwd: :func:`grouped_linear` · bwd: input gradient now, weight gradient queued"""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        counts: list[int] | Tensor,
        use_grouped_mm: bool,
        params: tuple[Tensor],
        store: WeightGradStore,
        into_main: Tensor | None,
    ) -> Tensor:
        ctx.save_for_backward(x, weight, *([counts] if isinstance(counts, Tensor) else []))
        ctx.counts = None if isinstance(counts, Tensor) else counts
        # the parameter in a tuple: an edge to it would run its accumulator (and hooks) in B
        ctx.fast, ctx.params, ctx.store = use_grouped_mm, params, store
        ctx.into_main = into_main
        return grouped_linear(x, weight, counts, use_grouped_mm)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, *device_counts = ctx.saved_tensors
        counts = device_counts[0] if device_counts else ctx.counts
        fast, (param,) = ctx.fast, ctx.params
        grad = grad.contiguous()  # [M, out]

        into_main = ctx.into_main

        def wgrad() -> tuple[Tensor | None, ...]:
            if into_main is not None:  # see mega_moe.wgrad_accum: the wrapper drops the tensor
                ends = _offsets(counts, x.device)
                return (wgrad_into_main_grad(grad, x, ends, param, into_main, fast),)
            w = _grouped_wgrad(grad, x, counts, fast, weight.shape[0])  # [L, out, in]
            return (w.view(param.shape).to(param.dtype),)

        ctx.store.defer(wgrad, ctx.params)
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None, None
        # [M, out] -> [M, in]: rows of expert l times weight[l]
        grad_x = grouped_linear(grad, weight.transpose(1, 2), counts, fast)
        return grad_x, None, None, None, None, None, None


def split_grouped_linear(
    x: Tensor,
    weight: Tensor,
    counts: list[int] | Tensor,
    use_grouped_mm: bool,
    param: Tensor,
    store: WeightGradStore,
    into_main: Tensor | None = None,
) -> Tensor:
    """:func:`grouped_linear` whose weight gradient ``store`` computes in the W pass.

    ``weight`` is ``[L, out, in]``, a view of the parameter ``param`` (which receives the
    gradient, in its own shape). ``into_main``: the key (``register_wgrad_target``) under
    which the W pass finds the ``main_grad`` it adds the gradient into itself, as
    :mod:`mega_moe.wgrad_accum` describes.
    """
    out: Tensor = _SplitGroupedLinear.apply(
        x, weight.detach(), counts, use_grouped_mm, (param,), store, into_main
    )
    return out


def expert_activation(h: Tensor, gated: bool) -> Tensor:
    """SwiGLU on ``[..., 2*f]`` (gate half, then up half) or tanh-GeLU on ``[..., f]``."""
    if gated:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh")
