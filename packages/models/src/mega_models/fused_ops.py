"""Elementwise fusions for an eager model: the MLP activation and RoPE as compiled regions.

An eager step runs each elementwise op as its own kernel: SwiGLU is a SiLU and a product
forward (two full reads and writes of the ``[tokens, 2 ffn]`` activation where one would
do) and four kernels backward, RoPE five kernels for q and five for k. With
``GPTConfig.fused_elementwise`` (by default on CUDA) each runs as one ``torch.compile``
region (Inductor writes one kernel for its forward and one for its backward), as
Megatron-core's ``jit_fuser`` does for its bias-activation fusions, while the rest of the
model stays eager. Under a whole-model
``torch.compile`` the plain functions are traced into the model's graph instead, so nothing
is compiled twice. The regions compute what the plain functions do up to the rounding of
reordered elementwise arithmetic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from mega_models.rope import apply_rope

__all__ = ["activation", "rope_qk", "run_fused"]

_F = TypeVar("_F", bound=Callable[..., Any])


def activation(y: Tensor, kind: str) -> Tensor:
    """The MLP's activation of the first GEMM's output: ``swiglu`` (gate and up interleaved
    one by one along the last dim), ``relu2`` (squared ReLU) or ``gelu`` (tanh)."""
    if kind == "swiglu":
        # unbind, not indexing: its backward writes both halves in one stacking kernel,
        # where two selects' backwards would each fill a zero tensor and then be added
        gate, up = y.reshape(*y.shape[:-1], y.shape[-1] // 2, 2).unbind(-1)
        return F.silu(gate) * up
    if kind == "relu2":
        return torch.square(F.relu(y))
    return F.gelu(y, approximate="tanh")


def rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`mega_models.rope.apply_rope` on the queries and the keys."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


@functools.cache
def _compiled(fn: _F) -> _F:
    """``fn`` as a compiled region, built on first use (``torch.compile`` imports dynamo)."""
    return torch.compile(fn)  # type: ignore[return-value]


def run_fused(fuse: bool | None, fn: Callable[..., Any], *args: Tensor | str) -> Any:
    """``fn(*args)``, as a compiled region when ``fuse`` (None: when the first argument is
    a CUDA tensor) and not already inside a compiled graph (where ``fn`` is traced into
    that graph)."""
    if fuse is None:
        first = args[0]
        fuse = isinstance(first, Tensor) and first.is_cuda
    if not fuse or torch.compiler.is_compiling():
        return fn(*args)
    return _compiled(fn)(*args)
