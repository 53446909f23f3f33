"""How a linear layer's GEMMs run in FP8: :class:`Fp8Recipe` and the checks of its settings.

The recipe is plain data, checked once when it is made; ``mega_tp_layers.fp8`` runs it. The
delayed-scaling settings are checked by functions the trainer's configuration checks call
too, so both say the same sentence under their own names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from mega_tp_layers.fp8_gemm import FP8_DTYPES, fp8_gemm_supported
from mega_tp_layers.fp8_scaling import SCALINGS

__all__ = ["Fp8Recipe", "check_amax_history", "check_amax_interval", "check_amax_margin"]

#: The largest ``amax_margin``: 2^8 of headroom already costs half of e4m3's exponent range.
MAX_MARGIN = 8


def _count(label: str, value: object, low: int, high: int | None, meaning: str) -> int:
    """``value`` as an integer in ``[low, high]`` (no upper bound: None), else one sentence."""
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < low
        or (high is not None and value > high)
    ):
        if high is not None:
            kind = f"an integer from {low} to {high}"
        else:
            kind = "a non-negative integer" if low == 0 else "a positive integer"
        raise ValueError(f"{label} ({value!r}) must be {kind}: {meaning}")
    return value


def check_amax_history(label: str, value: object) -> int:
    """A delayed-scaling history length named ``label``: 0 (current scaling) or more."""
    return _count(label, value, 0, None, "0 for current scaling, n > 0 for delayed scaling "
                                         "over the last n steps")  # fmt: skip


def check_amax_margin(label: str, value: object) -> int:
    """Delayed scaling's headroom exponent named ``label``: 0 to :data:`MAX_MARGIN`."""
    return _count(label, value, 0, MAX_MARGIN, "the delayed scales leave 2^margin of headroom "
                                               "above the history's amax")  # fmt: skip


def check_amax_interval(label: str, value: object) -> int:
    """Delayed scaling's recording interval named ``label``: 1 (every step) or more."""
    return _count(label, value, 1, None, "amaxes are recorded every interval-th step "
                                         "(1: every step)")  # fmt: skip


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
            if value not in FP8_DTYPES:
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
        history = check_amax_history("Fp8Recipe.amax_history", self.amax_history)
        if history and self.scaling != "tensor":
            raise ValueError(
                f"Fp8Recipe(amax_history={history}) is delayed scaling, which is tensor-wise "
                f"only, not scaling={self.scaling!r}; use scaling='tensor' or amax_history=0"
            )
        margin = check_amax_margin("Fp8Recipe.amax_margin", self.amax_margin)
        if margin and not history:
            raise ValueError(
                f"Fp8Recipe(amax_margin={margin}) gives delayed scaling headroom, but "
                "amax_history is 0 (current scaling never saturates); set amax_history=n "
                "or amax_margin=0"
            )
        interval = check_amax_interval("Fp8Recipe.amax_interval", self.amax_interval)
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
