"""FP8 GEMMs for the linear layers: dynamic scaling through ``torch._scaled_mm``.

``Fp8Recipe.scaling`` picks the granularity: ``"tensor"`` (described here, the default),
``"row"`` or ``"block"`` (DeepSeek-V3's 1x128 / 128x128 tiles; see ``fp8_scaling``).

Every GEMM operand is quantised when it is used: the amax of the whole tensor gives
``scale = fp8_max / max(amax, eps)``. Under tensor parallelism an operand that is a shard
(passed with its group) takes the amax all-reduced (max) over that group, so every rank
scales its shard as the whole tensor and the result is the same at any tp; the fp8
value is ``x * scale``, clamped to the format's range and rounded to nearest. The GEMM
multiplies the fp8 operands with an fp32 accumulator and then multiplies the result by
both inverse scales. The three GEMMs of a linear layer (``y = x W^T``):

- forward ``x @ W^T``: x and W in ``fwd_dtype`` (e4m3)
- dgrad ``dy @ W``: dy in ``grad_dtype`` (e5m2), W in ``fwd_dtype``
- wgrad ``dy^T @ x``: dy in ``grad_dtype``, x in ``fwd_dtype``

On CUDA devices of compute capability 8.9 or newer the GEMM is ``torch._scaled_mm``.
Elsewhere it is emulated exactly: the same fp8 values are widened to fp32, multiplied by an
fp32 matmul and scaled by the same inverse scales, so CPU tests see the quantisation
numerics. ``_scaled_mm`` needs every GEMM dimension to be a multiple of 16; a GEMM whose
shapes do not qualify falls back to the high-precision matmul, with one warning per shape,
and both paths make that choice the same way. Scales stay on the device (no host sync),
and nothing branches on tensor values, so ``torch.compile`` traces it without breaks.

``Fp8Recipe(amax_history=n)`` scales the input and the output gradient from the amaxes of
the last n steps instead (delayed scaling, ``fp8_delayed``): the layer passes its
:class:`~mega_tp_layers.Fp8AmaxHistory`'s :class:`Fp8Delayed` as ``delayed``.

Under :func:`~mega_tp_layers.defer_weight_grads` (``fp8_linear(..., store=...)``) the
backward runs the dgrad GEMM and leaves the wgrad GEMM, on the same quantised gradient and
the forward's fp8 input, to the store's W pass (row/block: the wgrad GEMM quantises the
gradient and the input along its own axes there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd import Function
from torch.distributed import ProcessGroup

from mega_tp_layers.fp8_delayed import Fp8Delayed, recorded_amax
from mega_tp_layers.fp8_gemm import (
    FP8_ALIGNMENT,
    Fp8Tensor,
    fp8_gemm_fits,
    fp8_gemm_supported,
    fp8_quantize,
    fp8_quantize_by_amax,
    scaled_gemm,
    warn_unaligned,
)
from mega_tp_layers.fp8_recipe import Fp8Recipe
from mega_tp_layers.fp8_scaling import (
    Fp8Shard,
    Fp8Tiles,
    as_dtype,
    operand_tile,
    quantize_tiles,
    tiled_gemm,
)
from mega_tp_layers.wgrad import WeightGradStore

__all__ = [
    "FP8_ALIGNMENT",
    "Fp8Recipe",
    "Fp8Shard",
    "Fp8Tensor",
    "check_delayed",
    "check_weight_q",
    "fp8_gemm_fits",
    "fp8_gemm_supported",
    "fp8_linear",
    "fp8_linear_dgrad",
    "fp8_linear_forward",
    "fp8_linear_wgrad",
    "fp8_quantize",
    "fp8_quantize_by_amax",
    "scaled_gemm",
    "shared_grad",
    "warn_unaligned",
]

_HIGH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: The group an operand is a shard of: bare (tensor-wise only) or with its dim.
Shard = ProcessGroup | Fp8Shard | None


def _check_pair(
    what: str,
    a: Tensor | Fp8Tensor,
    b: Tensor,
    a_dim: int,
    b_dim: int,
    *,
    b_quantised: bool = False,
) -> None:
    shape_a = tuple((a.data if isinstance(a, Fp8Tensor) else a).shape)
    for label, t in (("first", a), ("second", b)):
        if label == "second" and b_quantised:
            continue  # the data of an Fp8Tensor
        if not isinstance(t, Fp8Tensor) and t.dtype not in _HIGH_DTYPES:
            raise ValueError(
                f"{what}: the {label} operand has dtype {t.dtype}; pass an fp32, bf16 or fp16 "
                "tensor (the function quantises it)"
            )
    if len(shape_a) != 2 or b.dim() != 2 or shape_a[a_dim] != b.shape[b_dim]:
        raise ValueError(
            f"{what} needs two 2-D operands whose dims {a_dim} and {b_dim} agree, got shapes "
            f"{shape_a} and {tuple(b.shape)}; flatten the leading dims to [tokens, features]"
        )


def _as_grad(
    grad2d: Tensor | Fp8Tensor, recipe: Fp8Recipe, group: ProcessGroup | None = None
) -> Fp8Tensor:
    if isinstance(grad2d, Fp8Tensor):
        return grad2d
    return fp8_quantize(grad2d, recipe.grad_format, recipe.eps, group)


def _grad_values(grad2d: Tensor | Fp8Tensor) -> Tensor:
    return grad2d.dequantize() if isinstance(grad2d, Fp8Tensor) else grad2d


def fp8_linear_forward(
    x2d: Tensor,
    weight: Tensor,
    recipe: Fp8Recipe,
    *,
    out_dtype: torch.dtype | None = None,
    x_group: Shard = None,
    w_group: Shard = None,
    x_amax: Tensor | None = None,
    weight_q: Fp8Tensor | None = None,
) -> Tensor:
    """``x2d @ weight.T``: ``[M, K] x [N, K] -> [M, N]``, both in ``recipe.fwd_dtype``.

    The result has ``out_dtype`` (default: ``x2d``'s dtype). ``x_group`` / ``w_group``: the
    group an operand is a shard of (its scale is then the whole tensor's, see
    :func:`fp8_quantize`); the same for the ``*_group`` arguments of the other GEMMs.
    Row/block scaling needs each as an :class:`Fp8Shard` (which dim is split).
    ``x_amax``: the amax to scale ``x2d`` by (delayed scaling), instead of its own.
    ``weight_q``: ``weight`` quantised already (tensor-wise: a layer's weight cache).
    """
    _check_pair("fp8_linear_forward", x2d, weight, 1, 1)
    check_weight_q("fp8_linear_forward", weight_q, weight, recipe)
    out_dtype = out_dtype if out_dtype is not None else x2d.dtype
    dims = (x2d.shape[0], x2d.shape[1], weight.shape[0])
    if not fp8_gemm_fits(*dims):
        warn_unaligned("forward", dims)
        return as_dtype(x2d @ weight.t(), out_dtype)
    if recipe.scaling != "tensor":
        xt = _tiles(x2d, recipe.fwd_dtype, recipe, 1, False, x_group, "the input")
        wt = _tiles(weight, recipe.fwd_dtype, recipe, 1, True, w_group, "the weight")
        return tiled_gemm(xt, wt.t(), out_dtype, recipe, forward=True)
    xq = _quantize(x2d, recipe.fwd_dtype, recipe, x_group, x_amax)
    if weight_q is None:
        weight_q = fp8_quantize(weight, recipe.fwd_dtype, recipe.eps, _group(w_group))
    w_t = Fp8Tensor(weight_q.data.t(), weight_q.inv_scale)
    return scaled_gemm(xq, w_t, out_dtype, recipe, forward=True)


def check_weight_q(
    owner: str, weight_q: Fp8Tensor | None, weight: Tensor, recipe: Fp8Recipe
) -> None:
    """A given quantised weight is ``weight``'s, tensor-wise, in the recipe's format."""
    if weight_q is None:
        return
    if recipe.scaling != "tensor":
        raise ValueError(
            f"{owner} got a quantised weight, which is tensor-wise, but the recipe scales "
            f"{recipe.scaling}-wise; pass weight_q=None (each GEMM tiles the weight itself)"
        )
    data = weight_q.data
    if tuple(data.shape) != tuple(weight.shape) or data.dtype != recipe.fwd_dtype:
        raise ValueError(
            f"{owner} got a quantised weight of shape {tuple(data.shape)} and dtype "
            f"{data.dtype} for a weight of shape {tuple(weight.shape)} and a recipe in "
            f"{recipe.fwd_dtype}; pass the layer's own weight quantised in fwd_dtype"
        )


def _quantize(
    t: Tensor, dtype: torch.dtype, recipe: Fp8Recipe, group: Shard, amax: Tensor | None
) -> Fp8Tensor:
    """``t`` tensor-wise by its own amax (over ``group``), or by a delayed-scaling ``amax``."""
    if amax is not None:
        return fp8_quantize_by_amax(t, amax, dtype, recipe.eps)
    return fp8_quantize(t, dtype, recipe.eps, _group(group))


def fp8_linear_dgrad(
    grad2d: Tensor | Fp8Tensor,
    weight: Tensor,
    recipe: Fp8Recipe,
    *,
    out_dtype: torch.dtype | None = None,
    weight_q: Fp8Tensor | None = None,
    g_group: Shard = None,
    w_group: Shard = None,
) -> Tensor:
    """``grad2d @ weight``: ``[M, N] x [N, K] -> [M, K]``, the gradient in ``grad_dtype``.

    ``grad2d`` may be already quantised (an :class:`Fp8Tensor`, shared with the wgrad),
    and ``weight_q`` may be ``weight`` quantised already (by the forward GEMM).
    The result has ``out_dtype`` (default: ``weight``'s dtype).
    """
    _check_pair("fp8_linear_dgrad", grad2d, weight, 1, 0)
    out_dtype = out_dtype if out_dtype is not None else weight.dtype
    dims = (weight.shape[0], weight.shape[1], _rows(grad2d))
    if not fp8_gemm_fits(*dims):
        warn_unaligned("dgrad", dims)
        return as_dtype(_grad_values(grad2d).to(weight.dtype) @ weight, out_dtype)
    if recipe.scaling != "tensor":
        gt = _tiles(_plain(grad2d, recipe), recipe.grad_format, recipe, 1, False, g_group,
                    "the output gradient")  # fmt: skip
        wt = _tiles(weight, recipe.fwd_dtype, recipe, 0, True, w_group, "the weight")
        return tiled_gemm(gt, wt, out_dtype, recipe, forward=False)
    if weight_q is None:
        weight_q = fp8_quantize(weight, recipe.fwd_dtype, recipe.eps, _group(w_group))
    return scaled_gemm(_as_grad(grad2d, recipe, _group(g_group)), weight_q, out_dtype, recipe)


def fp8_linear_wgrad(
    grad2d: Tensor | Fp8Tensor,
    x2d: Tensor | Fp8Tensor,
    recipe: Fp8Recipe,
    *,
    out_dtype: torch.dtype | None = None,
    g_group: Shard = None,
    x_group: Shard = None,
    x_amax: Tensor | None = None,
) -> Tensor:
    """``grad2d.T @ x2d``: ``[M, N]^T x [M, K] -> [N, K]``, the weight's gradient.

    ``grad2d`` (in ``grad_dtype``) may be already quantised; ``x2d`` is in ``fwd_dtype``,
    and may be quantised already too (the forward GEMM's fp8 input). The result has
    ``out_dtype`` (default: ``x2d``'s dtype; bf16 for a quantised ``x2d``). ``x_amax``:
    the amax to scale a high-precision ``x2d`` by (delayed scaling: the forward's).
    """
    x_plain = x2d.data if isinstance(x2d, Fp8Tensor) else x2d
    _check_pair("fp8_linear_wgrad", grad2d, x_plain, 0, 0, b_quantised=isinstance(x2d, Fp8Tensor))
    if out_dtype is None:
        out_dtype = torch.bfloat16 if isinstance(x2d, Fp8Tensor) else x2d.dtype
    g = grad2d.data if isinstance(grad2d, Fp8Tensor) else grad2d
    dims = (x_plain.shape[0], x_plain.shape[1], g.shape[1])
    if not fp8_gemm_fits(*dims):
        warn_unaligned("wgrad", dims)
        x_hp = x2d.dequantize() if isinstance(x2d, Fp8Tensor) else x2d
        return as_dtype(_grad_values(grad2d).to(x_hp.dtype).t() @ x_hp, out_dtype)
    if recipe.scaling != "tensor":  # both along the tokens: 128x1 tiles or per column
        gt = _tiles(_plain(grad2d, recipe), recipe.grad_format, recipe, 0, False, g_group,
                    "the output gradient")  # fmt: skip
        xt = _tiles(_plain(x2d, recipe), recipe.fwd_dtype, recipe, 0, False, x_group, "the input")
        return tiled_gemm(gt.t(), xt, out_dtype, recipe, forward=False)
    gq = _as_grad(grad2d, recipe, _group(g_group))
    xq = (
        x2d
        if isinstance(x2d, Fp8Tensor)
        else _quantize(x2d, recipe.fwd_dtype, recipe, x_group, x_amax)
    )
    return scaled_gemm(Fp8Tensor(gq.data.t(), gq.inv_scale), xq, out_dtype, recipe)


def _rows(t: Tensor | Fp8Tensor) -> int:
    return int((t.data if isinstance(t, Fp8Tensor) else t).shape[0])


def _group(shard: Shard) -> ProcessGroup | None:
    """The group of a shard, for tensor-wise scaling (one scalar: the dim does not matter)."""
    return shard.group if isinstance(shard, Fp8Shard) else shard


def _plain(t: Tensor | Fp8Tensor, recipe: Fp8Recipe) -> Tensor:
    if isinstance(t, Fp8Tensor):
        raise ValueError(
            f"Fp8Recipe(scaling={recipe.scaling!r}) quantises each GEMM's operands along its "
            "own axes, so it takes the high-precision tensor, not a tensor-wise Fp8Tensor"
        )
    return t


def _tiles(
    t: Tensor, dtype: torch.dtype, recipe: Fp8Recipe, contracted: int, weight: bool,
    shard: Shard, what: str,
) -> Fp8Tiles:  # fmt: skip
    tile = operand_tile(recipe.scaling, contracted, weight)
    return quantize_tiles(t, dtype, recipe.eps, tile, shard, what)


def shared_grad(
    grad2d: Tensor,
    in_features: int,
    recipe: Fp8Recipe,
    group: Shard = None,
    amax: Tensor | None = None,
) -> Tensor | Fp8Tensor:
    """The output gradient quantised once for both backward GEMMs, when they qualify.

    Row/block scaling quantises it along other axes for each GEMM: returned as it is.
    ``amax``: the amax to scale it by (delayed scaling), instead of its own over ``group``.
    """
    if recipe.scaling != "tensor":
        return grad2d
    if not fp8_gemm_fits(grad2d.shape[0], grad2d.shape[1], in_features):
        return grad2d
    return _quantize(grad2d, recipe.grad_format, recipe, group, amax)


def check_delayed(owner: str, recipe: Fp8Recipe | None, delayed: Fp8Delayed | None) -> None:
    """A delayed-scaling recipe comes with the layer's amax history, and only with one."""
    if recipe is not None and recipe.delayed and delayed is None:
        raise ValueError(
            f"{owner} with Fp8Recipe(amax_history={recipe.amax_history}) needs the layer's "
            "amax history: pass delayed=Fp8AmaxHistory(...).for_forward(x), as the linear "
            "layers do, or amax_history=0"
        )
    if delayed is not None and (recipe is None or not recipe.delayed):
        raise ValueError(
            f"{owner} got delayed=... but its recipe scales by the current amax "
            "(amax_history=0); drop delayed or set Fp8Recipe(amax_history=n)"
        )


class _Fp8Linear(Function):
    """fwd: fp8 GEMM (+ bias) · bwd: fp8 dgrad and wgrad from one quantised gradient

    When the GEMMs qualify, backward reuses the fp8 input and weight forward made (the
    same values a requantisation would give): the input is kept in 1 byte an element
    instead of 2, and neither is quantised twice. Row/block scaling keeps the input in its
    own dtype: the wgrad GEMM quantises it along the tokens, not along the features.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        recipe: Fp8Recipe,
        groups: tuple[Shard, Shard, Shard],
        deferred: tuple[WeightGradStore, Tensor, Tensor | None] | None,
        amax: Tensor | None,
        probe: Tensor | None,
        w_data: Tensor | None,
        w_inv: Tensor | None,
        w_col: Tensor | None,
    ) -> Tensor:
        ctx.recipe, ctx.x_dtype, ctx.groups = recipe, x.dtype, groups
        ctx.delayed = probe is not None  # delayed scaling: |dy|'s max is the probe's gradient
        x_amax, g_amax = (None, None) if amax is None else (amax[0], amax[1])
        ctx.deferred = deferred  # (store, weight, bias): the W pass runs later from the store
        x_group, w_group, _ = groups
        _check_pair("fp8_linear_forward", x, weight, 1, 1)
        if not fp8_gemm_fits(x.shape[0], x.shape[1], weight.shape[0]):
            ctx.quantised = False
            ctx.save_for_backward(x, weight)  # the high-precision fallback needs them as they are
            out = fp8_linear_forward(x, weight, recipe)  # warns once, runs in high precision
            return out if bias is None else out + bias
        ctx.quantised = True
        if recipe.scaling != "tensor":  # each GEMM quantises along its own axes
            ctx.save_for_backward(x, weight)
            out = fp8_linear_forward(x, weight, recipe, x_group=x_group, w_group=w_group)
            return out if bias is None else out + bias
        xq = _quantize(x, recipe.fwd_dtype, recipe, x_group, x_amax)  # [tokens, in]
        if w_data is not None and w_inv is not None:  # from the layer's weight cache
            wq = Fp8Tensor(w_data, w_inv)
        else:
            wq = fp8_quantize(weight, recipe.fwd_dtype, recipe.eps, _group(w_group))  # [out, in]
        ctx.save_for_backward(
            xq.data, xq.inv_scale, wq.data, wq.inv_scale, weight, g_amax, w_col
        )  # w_col: a weight cache's column-major copy, for the dgrad GEMM
        out = scaled_gemm(xq, Fp8Tensor(wq.data.t(), wq.inv_scale), x.dtype, recipe, forward=True)
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        recipe: Fp8Recipe = ctx.recipe
        x_group, w_group, g_group = ctx.groups  # tensor-wise: x and W are quantised already
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if ctx.deferred is not None:
            need_w, need_b = True, ctx.deferred[2] is not None
        x: Tensor | Fp8Tensor
        wq: Fp8Tensor | None = None
        g: Tensor | Fp8Tensor = grad
        per_gemm = ctx.quantised and recipe.scaling != "tensor"  # quantised by each GEMM
        if per_gemm:
            x, weight = ctx.saved_tensors
        elif ctx.quantised:
            x_data, x_inv, w_data, w_inv, weight, g_amax, w_col = ctx.saved_tensors
            x, wq = Fp8Tensor(x_data, x_inv), Fp8Tensor(w_data, w_inv, w_col)
            if need_x or need_w:
                g = shared_grad(grad, weight.shape[1], recipe, g_group, g_amax)
        else:
            x, weight = ctx.saved_tensors  # the high-precision fallback: no quantisation
        grad_x = None
        if need_x:
            out_dtype = ctx.x_dtype
            grad_x = fp8_linear_dgrad(
                g,
                weight,
                recipe,
                out_dtype=out_dtype,
                weight_q=wq,
                g_group=g_group if per_gemm else None,
                w_group=w_group if per_gemm else None,
            )

        def wgrad() -> tuple[Tensor | None, Tensor | None]:
            grad_w = None
            if need_w:
                grad_w = fp8_linear_wgrad(
                    g,
                    x,
                    recipe,
                    out_dtype=weight.dtype,
                    g_group=g_group if per_gemm else None,
                    x_group=x_group if per_gemm else None,
                )
            return grad_w, grad.sum(dim=0) if need_b else None

        probe_grad = recorded_amax(grad) if ctx.delayed else None
        if ctx.deferred is not None:
            store, w_param, b_param = ctx.deferred
            store.defer(wgrad, (w_param, b_param))
            return grad_x, None, None, None, None, None, None, probe_grad, None, None, None
        return grad_x, *wgrad(), None, None, None, None, probe_grad, None, None, None


def fp8_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    recipe: Fp8Recipe,
    x_group: Shard = None,
    w_group: Shard = None,
    g_group: Shard = None,
    store: WeightGradStore | None = None,
    delayed: Fp8Delayed | None = None,
    weight_q: Fp8Tensor | None = None,
) -> Tensor:
    """``F.linear(x, weight, bias)`` with its forward, dgrad and wgrad GEMMs in fp8.

    ``x`` is ``[..., in]``; the bias is added in high precision and its gradient is the
    high-precision sum of the output gradient. ``x_group`` / ``w_group`` / ``g_group``:
    the group that ``x``, ``weight`` or the output gradient is a shard of, so that each is
    scaled as the whole tensor (tensor parallelism then quantises as one process would);
    row/block scaling needs them as :class:`Fp8Shard` (group, dim). With ``store`` (a
    :class:`~mega_tp_layers.WeightGradStore`) the weight and bias gradients are left to its
    W pass. ``delayed``: a delayed-scaling recipe's scales and probe (``fp8_delayed``).
    ``weight_q``: ``weight`` quantised already, tensor-wise (a layer's
    :class:`~mega_tp_layers.Fp8WeightCache`); the forward and the dgrad GEMM use it.
    """
    check_delayed("fp8_linear", recipe, delayed)
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fp8_linear needs x [..., in] and weight [out, in] with matching in, got shapes "
            f"{tuple(x.shape)} and {tuple(weight.shape)}; pass a weight of in_features columns"
        )
    check_weight_q("fp8_linear", weight_q, weight, recipe)
    x2d = x.reshape(-1, x.shape[-1])  # [..., in] -> [tokens, in]
    groups = (x_group, w_group, g_group)
    amax, probe = (None, None) if delayed is None else delayed
    w8 = (None,) * 3 if weight_q is None else tuple(weight_q)
    if store is not None:  # the weight leaves the graph: its gradient arrives in the W pass
        deferred = (store, weight, bias)
        w, b = weight.detach(), None if bias is None else bias.detach()
        out: Tensor = _Fp8Linear.apply(x2d, w, b, recipe, groups, deferred, amax, probe, *w8)
    else:
        out = _Fp8Linear.apply(x2d, weight, bias, recipe, groups, None, amax, probe, *w8)
    return out.view(*x.shape[:-1], weight.shape[0])  # a view outside the Function
