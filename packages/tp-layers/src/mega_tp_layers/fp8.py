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

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor
from torch.autograd import Function
from torch.distributed import ProcessGroup

from mega_tp_layers._comm import all_reduce_max, group_size
from mega_tp_layers.fp8_delayed import Fp8Delayed, recorded_amax
from mega_tp_layers.fp8_scaling import (
    SCALINGS,
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

#: ``torch._scaled_mm`` needs every GEMM dimension to be a multiple of this.
FP8_ALIGNMENT = 16

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_HIGH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: The group an operand is a shard of: bare (tensor-wise only) or with its dim.
Shard = ProcessGroup | Fp8Shard | None


@dataclass(frozen=True)
class Fp8Recipe:
    """How a linear layer's three GEMMs run in FP8: scales from the current amax."""

    fwd_dtype: torch.dtype = torch.float8_e4m3fn
    """Format of inputs and weights (3 mantissa bits: relative rounding error <= 2^-4)."""
    grad_dtype: torch.dtype | None = None
    """Format of output gradients; None: e5m2 (2 mantissa bits, wider range: relative error
    <= 2^-3) for tensor- and row-wise scaling, e4m3 for block-wise (DeepSeek-V3's choice, whose
    fine scales leave no need for e5m2's range; cuBLAS's block-scaled GEMM takes e4m3 only).
    :attr:`grad_format` is the format in use."""
    eps: float = 1e-12
    """Floor on amax, so that an all-zero tensor gets a finite scale."""
    emulate: bool | None = None
    """True: always emulate; False: always ``torch._scaled_mm`` (CUDA sm89+); None: auto."""
    fast_accum_forward: bool = True
    """The forward GEMM accumulates in the tensor cores' fast mode (``use_fast_accum``, no
    periodic promotion to fp32: faster, less precise over long K); dgrad and wgrad never do.
    The exact emulation accumulates in fp32 either way."""
    scaling: Literal["tensor", "row", "block"] = "tensor"
    """One scale per tensor; per row along each operand's non-contracted dimension; or per
    1x128 tile of activations and gradients and 128x128 block of weights (``fp8_scaling``).
    Under ``torch.compile`` on the GPU (torch 2.11) all three give eager's gradients
    (``bench/fp8_compile_check.py``: block-wise on the H200, 2026-12-05; row-wise on an H100,
    2026-12-06, after its GEMM results stopped passing through a no-op cast)."""
    amax_history: int = 0
    """0: every scale from the current amax of the tensor it quantises. n > 0 (tensor-wise
    only): the input's and the output gradient's scales from the max amax of the last n
    steps (delayed scaling, ``mega_tp_layers.fp8_delayed``), so the casts need no reduction
    first and can fuse into the kernels producing those tensors; the first step scales by
    the current amax. Megatron's ``fp8_amax_history_len``."""
    amax_margin: int = 0
    """Delayed scaling only: the scales leave 2^margin of headroom above the history's amax
    (Transformer Engine's ``margin``), so a tensor growing up to 2^margin x between steps
    does not saturate; each margin step costs one bit of the format's resolution at the top.
    ``update_fp8_amax_histories(..., overshoot=)`` measures how far a run's tensors grow."""
    amax_interval: int = 1
    """Delayed scaling only: amaxes are recorded on one step in ``amax_interval``
    (:func:`~mega_tp_layers.set_fp8_amax_recording`); the steps between scale from the
    history with no amax reduction at all, as fixed scales would. Each history entry is then
    one recorded step's."""
    cache_weights: bool = False
    """True (tensor-wise only): each layer keeps its fp8 weight from the first forward after
    :func:`~mega_tp_layers.invalidate_fp8_weight_caches` to the next, so the micro-batches of
    one step quantise every weight once (``fp8_weight_cache``; two bytes a parameter held:
    the fp8 weight and its transpose for the dgrad GEMM). Whoever changes the weights
    invalidates; the trainer does so at every step."""

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(
                f"Fp8Recipe.scaling ({self.scaling!r}) is not one of {', '.join(SCALINGS)}; "
                "pick one of those"
            )
        for label, value in (("fwd_dtype", self.fwd_dtype), ("grad_dtype", self.grad_format)):
            if value not in _FP8_DTYPES:
                raise ValueError(
                    f"Fp8Recipe.{label} ({value}) is not an fp8 format; "
                    "use torch.float8_e4m3fn or torch.float8_e5m2"
                )
        if self.scaling == "block" and torch.float8_e5m2 in (self.fwd_dtype, self.grad_format):
            raise ValueError(
                "Fp8Recipe(scaling='block') quantises every operand in torch.float8_e4m3fn "
                "(cuBLAS's block-scaled GEMM refuses e5m2: 'Invalid scaling configuration' on "
                "the H200); leave fwd_dtype and grad_dtype at their defaults"
            )
        if self.fwd_dtype == self.grad_format == torch.float8_e5m2:
            raise ValueError(
                "Fp8Recipe has fwd_dtype and grad_dtype both torch.float8_e5m2, which "
                "torch._scaled_mm cannot multiply together; keep fwd_dtype=torch.float8_e4m3fn"
            )
        if not isinstance(self.fast_accum_forward, bool):
            raise ValueError(
                f"Fp8Recipe.fast_accum_forward ({self.fast_accum_forward!r}) must be True or False"
            )
        history = self.amax_history
        if not isinstance(history, int) or isinstance(history, bool) or history < 0:
            raise ValueError(
                f"Fp8Recipe.amax_history ({history!r}) must be a non-negative integer: 0 for "
                "current scaling, n > 0 for delayed scaling over the last n steps"
            )
        if history and self.scaling != "tensor":
            raise ValueError(
                f"Fp8Recipe(amax_history={history}) is delayed scaling, which is tensor-wise "
                f"only, not scaling={self.scaling!r}; use scaling='tensor' or amax_history=0"
            )
        margin = self.amax_margin
        if not isinstance(margin, int) or isinstance(margin, bool) or not 0 <= margin <= 8:
            raise ValueError(
                f"Fp8Recipe.amax_margin ({margin!r}) must be an integer from 0 to 8: the "
                "scales leave 2^margin of headroom above the history's amax"
            )
        if margin and not history:
            raise ValueError(
                f"Fp8Recipe(amax_margin={margin}) gives delayed scaling headroom, but "
                "amax_history is 0 (current scaling never saturates); set amax_history=n "
                "or amax_margin=0"
            )
        interval = self.amax_interval
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(
                f"Fp8Recipe.amax_interval ({interval!r}) must be a positive integer: amaxes "
                "are recorded every interval-th step (1: every step)"
            )
        if interval > 1 and not history:
            raise ValueError(
                f"Fp8Recipe(amax_interval={interval}) spaces delayed scaling's recording, but "
                "amax_history is 0; set amax_history=n or amax_interval=1"
            )
        if not isinstance(self.cache_weights, bool):
            raise ValueError(
                f"Fp8Recipe.cache_weights ({self.cache_weights!r}) must be True or False"
            )
        if self.cache_weights and self.scaling != "tensor":
            raise ValueError(
                f"Fp8Recipe(cache_weights=True) keeps a tensor-wise fp8 weight, not "
                f"scaling={self.scaling!r} (each GEMM tiles the weight its own way); use "
                "scaling='tensor' or cache_weights=False"
            )
        if not (isinstance(self.eps, float | int) and math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"Fp8Recipe.eps ({self.eps!r}) must be a positive finite number")

    @property
    def delayed(self) -> bool:
        """Whether scales come from an amax history (``amax_history > 0``)."""
        return self.amax_history > 0

    @property
    def grad_format(self) -> torch.dtype:
        """The output gradients' fp8 format (``grad_dtype``, or the scaling's default)."""
        if self.grad_dtype is not None:
            return self.grad_dtype
        return torch.float8_e4m3fn if self.scaling == "block" else torch.float8_e5m2

    def emulated_on(self, device: torch.device) -> bool:
        """Whether GEMMs on ``device`` are emulated (``emulate``, or auto: no sm89+ GPU)."""
        if self.emulate is not None:
            return self.emulate
        return not fp8_gemm_supported(device)


class Fp8Tensor(NamedTuple):
    """An fp8 tensor and its fp32 scalar inverse scale: ``data.float() * inv_scale ~ x``."""

    data: Tensor
    inv_scale: Tensor
    col_major: Tensor | None = None
    """``data``'s values stored column-major (a transposed copy kept by its owner, e.g. a
    weight cache), which a GEMM taking this tensor as its second operand then need not make."""

    def dequantize(self) -> Tensor:
        """The fp32 values this tensor stands for."""
        return self.data.float() * self.inv_scale


def fp8_gemm_supported(device: torch.device) -> bool:
    """True when ``torch._scaled_mm`` runs on ``device`` (CUDA, compute capability >= 8.9)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_gemm_fits(*dims: int) -> bool:
    """True when every GEMM dimension is a multiple of :data:`FP8_ALIGNMENT`."""
    return all(d % FP8_ALIGNMENT == 0 for d in dims)


def fp8_quantize(
    x: Tensor, dtype: torch.dtype, eps: float = 1e-12, group: ProcessGroup | None = None
) -> Fp8Tensor:
    """``x`` in the fp8 ``dtype`` with one scale for the whole tensor (its current amax).

    With ``group``, ``x`` is this rank's shard of a tensor split over the group: the amax
    is the max over every rank's shard (one scalar all-reduce, no host sync), so each shard
    is quantised exactly as the whole tensor would be.
    """
    if dtype not in _FP8_DTYPES:
        raise ValueError(
            f"fp8_quantize dtype ({dtype}) is not an fp8 format; "
            "use torch.float8_e4m3fn or torch.float8_e5m2"
        )
    x32 = x.detach().float()
    amax = x32.abs().amax()
    if group is not None and group_size(group) > 1:
        all_reduce_max(amax, group)  # the whole tensor's amax
    return fp8_quantize_by_amax(x32, amax, dtype, eps)


def fp8_quantize_by_amax(
    x: Tensor, amax: Tensor, dtype: torch.dtype, eps: float = 1e-12
) -> Fp8Tensor:
    """``x`` in the fp8 ``dtype`` with the scale of a given ``amax`` (an fp32 scalar tensor).

    The amax may be that of a larger tensor ``x`` is part of (e.g. reduced over ranks), so
    that slices quantised apart get the values quantising the whole would give.
    """
    fmax = torch.finfo(dtype).max
    scale = fmax / amax.float().clamp(min=eps)  # fp32 scalar, on x's device
    data = (x.detach().float() * scale).clamp(-fmax, fmax).to(dtype)
    return Fp8Tensor(data, scale.reciprocal())


def scaled_gemm(
    a: Fp8Tensor,
    b: Fp8Tensor,
    out_dtype: torch.dtype,
    recipe: Fp8Recipe,
    *,
    forward: bool = False,
) -> Tensor:
    """``dequant(a) @ dequant(b)`` for ``a`` ``[M, K]`` and ``b`` ``[K, N]``, in ``out_dtype``.

    ``forward``: a forward GEMM, which accumulates fast if ``recipe.fast_accum_forward``.
    """
    device = a.data.device
    if recipe.emulated_on(device):
        acc = a.data.float() @ b.data.float()  # products of fp8 values are exact in fp32
        return as_dtype(acc * (a.inv_scale * b.inv_scale), out_dtype)
    if not fp8_gemm_supported(device):
        raise ValueError(
            f"Fp8Recipe(emulate=False) needs a CUDA device of compute capability 8.9 or newer "
            f"for torch._scaled_mm, but the tensors are on {device}; use emulate=None (auto)"
        )
    # _scaled_mm wants a row-major, b column-major: both copies are no-ops when already so
    b_data = b.col_major if b.col_major is not None else b.data.t().contiguous().t()
    out: Tensor = torch._scaled_mm(
        a.data.contiguous(),
        b_data,
        scale_a=a.inv_scale,
        scale_b=b.inv_scale,
        out_dtype=out_dtype,
        use_fast_accum=forward and recipe.fast_accum_forward,
    )
    return out


@functools.cache
def warn_unaligned(what: str, dims: tuple[int, ...]) -> None:
    warnings.warn(
        f"fp8 {what} GEMM of dims {dims} is not a multiple of {FP8_ALIGNMENT} in every "
        "dimension, as torch._scaled_mm needs; it runs in high precision instead",
        stacklevel=3,
    )


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
