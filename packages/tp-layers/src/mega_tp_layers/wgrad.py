"""Split backward: input gradients in the backward pass, weight gradients later (a W pass).

Zero-bubble pipeline schedules run a stage's backward in two parts: ``B`` computes the
gradient of the stage's input (which the previous stage waits for) and ``W`` the weight
gradients (which nothing waits for, so they fill the pipeline's bubbles). A forward run
inside :func:`defer_weight_grads` marks the linear layers it passes through: their
backward then computes only the input gradient and leaves ``(input, output gradient)`` in
the store the context yielded; :meth:`WeightGradStore.run` later computes the weight (and
column bias) gradients from them and accumulates each into its parameter through
autograd, so ``.grad`` (or a data-parallel wrapper's ``main_grad``) receives exactly what
the fused backward would have given and every post-accumulate-grad hook fires then, once.

The decision is taken in forward because a weight that took part in the forward graph
has its gradient accumulator run in backward even when no gradient reaches it, and a
data-parallel wrapper counts that as the gradient having arrived.

Layers that split: the column/row parallel linears (with sequence parallel, whose W pass
all-gathers the input again as the fused backward does, and with FP8), the
vocab-parallel embedding (its backward is all W), mega-models' norms and mega-moe's
experts. Any other module keeps its fused backward inside the context (a pipeline
schedule treats it as B+W fused): the ``tp_comm_overlap`` rings, Transformer Engine
layers, and parameters used directly (a learned position table, a router's weight,
Mamba's conv1d, ``A``/``D``/``dt`` and gated norm), and a linear whose input carries no
gradient (a stage's first layer fed data: its backward would have no B to hang W on).
The store knows nothing of the layers: each queues a closure and the parameters its
results belong to; a frozen parameter (``requires_grad`` off) gets no gradient from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function

from mega_tp_layers.main_grad_fusion import linear_into_main_grad, linear_wgrad_into_main_grad

__all__ = [
    "WeightGradStore",
    "current_weight_grad_store",
    "defer_weight_grads",
    "linear_with_wgrad",
    "split_linear",
]

#: computes (grad of each parameter or None) from what the backward saved
WeightGradFn = Callable[[], tuple[Tensor | None, ...]]


class _Current:
    """The innermost :func:`defer_weight_grads` store of this process (None outside one).

    A plain attribute, not a ContextVar: Dynamo reads it under ``torch.compile`` with a guard,
    where torch 2.11's Dynamo breaks the graph at ``ContextVar.get`` (once per linear). The
    schedules that defer run their forwards on the main thread only."""

    store: WeightGradStore | None = None


_CURRENT = _Current()


class WeightGradStore:
    """The weight-gradient passes deferred by one forward's backward, run by :meth:`run`."""

    def __init__(self) -> None:
        self._pending: list[tuple[WeightGradFn, tuple[Tensor | None, ...]]] = []

    def defer(self, compute: WeightGradFn, params: tuple[Tensor | None, ...]) -> None:
        """Queue ``compute``, whose results are the gradients of ``params`` (None: none)."""
        self._pending.append((compute, params))

    def __len__(self) -> int:
        return len(self._pending)

    def run(self) -> None:
        """Compute every queued weight gradient and accumulate it into its parameter.

        All gradients go through one autograd call, so each parameter's gradient
        accumulator (and the hooks on it) runs once, however many layers used it.
        """
        pending, self._pending = self._pending, []
        params, grads = _sum_by_param(pending)
        del pending
        if params:
            root = _Accumulate.apply(grads, *params)
            del grads  # the engine then holds each gradient alone and hands it over uncopied
            root.backward(torch.empty_like(root))


def _sum_by_param(
    pending: list[tuple[WeightGradFn, tuple[Tensor | None, ...]]],
) -> tuple[list[Tensor], list[Tensor]]:
    """Each parameter once, with the sum of the gradients the queued passes computed for it.

    A frozen parameter (``requires_grad`` off) takes no gradient, as in the fused backward;
    a pass whose parameters are all frozen is not computed."""
    grads: dict[int, tuple[Tensor, Tensor]] = {}
    for compute, params in pending:
        if not any(p is not None and p.requires_grad for p in params):
            continue
        with torch.no_grad():  # the gradients are values; autograd only accumulates them
            values = compute()
        for param, grad in zip(params, values, strict=True):
            if param is None or grad is None or not param.requires_grad:
                continue
            seen = grads.get(id(param))
            grads[id(param)] = (param, grad if seen is None else seen[1] + grad)
    return [p for p, _ in grads.values()], [g for _, g in grads.values()]


class _Accumulate(Function):
    """fwd: an empty root over ``params`` · bwd: their gradients ``grads``, as computed

    Handing the gradients back from inside the engine leaves it the only holder of each,
    so a parameter's accumulator takes the tensor as its ``.grad`` (as in a fused
    backward) instead of copying it, which it must do for a gradient that the caller of
    ``torch.autograd.backward(params, grads)`` still references.
    """

    @staticmethod
    def forward(ctx: Any, grads: list[Tensor], *params: Tensor) -> Tensor:
        ctx.grads = grads
        return torch.empty((), device=params[0].device)

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> tuple[Tensor | None, ...]:
        grads, ctx.grads = ctx.grads, None
        return None, *grads


@contextmanager
def defer_weight_grads() -> Iterator[WeightGradStore]:
    """Forwards inside defer their split layers' weight gradients to the yielded store."""
    store, outer = WeightGradStore(), _CURRENT.store
    _CURRENT.store = store
    try:
        yield store
    finally:
        _CURRENT.store = outer


def current_weight_grad_store() -> WeightGradStore | None:
    """The store of the innermost :func:`defer_weight_grads`, when grad mode is on."""
    return _CURRENT.store if torch.is_grad_enabled() else None


def flat_wgrad(
    grad: Tensor,
    inp: Tensor,
    with_bias: bool,
    into_main: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Weight and bias gradients of ``y = x W^T + b`` from ``[.., out]`` grad, ``[.., in]`` x.

    ``into_main``: ``(weight, key)`` whose gradient goes into its ``main_grad`` instead
    (:func:`~mega_tp_layers.main_grad_fusion.linear_wgrad_into_main_grad`)."""
    grad_2d = grad.reshape(-1, grad.shape[-1])  # [s*b, out]
    inp_2d = inp.reshape(-1, inp.shape[-1])  # [s*b, in]
    grad_b = grad_2d.sum(dim=0) if with_bias else None
    if into_main is not None:
        return linear_wgrad_into_main_grad(grad_2d, inp_2d, *into_main), grad_b
    return grad_2d.t().matmul(inp_2d), grad_b


class _SplitLinear(Function):
    """fwd: ``x W^T + b`` · bwd: input gradient now, weight/bias gradients queued in the store"""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        params: tuple[Tensor, Tensor | None],
        store: WeightGradStore,
        key: Tensor | None,
    ) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.params, ctx.store, ctx.key = params, store, key
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        params, key = ctx.params, ctx.key
        into_main = None if key is None else (params[0], key)
        ctx.store.defer(lambda: flat_wgrad(grad, x, params[1] is not None, into_main), params)
        grad_input = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        return grad_input, None, None, None, None, None


def split_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    store: WeightGradStore,
    wgrad_key: Tensor | None = None,
) -> Tensor:
    """``F.linear(x, weight, bias)`` whose weight and bias gradients ``store`` computes later.

    An input that carries no gradient (a stage's first layer fed data) gives the plain
    ``F.linear``: with nothing to differentiate in B, the split backward would never run
    and the weight would get no gradient, so its backward stays fused. ``wgrad_key``: the
    weight gradient goes into its ``main_grad`` (``mega_tp_layers.main_grad_fusion``).
    """
    if not x.requires_grad:
        if wgrad_key is not None:
            return linear_into_main_grad(x, weight, bias, wgrad_key)
        return F.linear(x, weight, bias)
    out = _SplitLinear.apply(
        x, weight.detach(), None if bias is None else bias.detach(), (weight, bias), store,
        wgrad_key,
    )  # fmt: skip
    assert isinstance(out, Tensor)
    return out


def linear_with_wgrad(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    store: WeightGradStore | None,
    wgrad_key: Tensor | None,
) -> Tensor:
    """``F.linear(x, weight, bias)`` whose weight gradient ``store`` (if any) computes in its
    W pass and which goes into ``weight.main_grad`` under ``wgrad_key`` (if any; see
    ``mega_tp_layers.main_grad_fusion``)."""
    if store is not None:
        return split_linear(x, weight, bias, store, wgrad_key)
    if wgrad_key is not None:
        return linear_into_main_grad(x, weight, bias, wgrad_key)
    return F.linear(x, weight, bias)
