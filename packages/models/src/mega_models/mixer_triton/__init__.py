"""The Mamba-2 mixer's two fused elementwise stages in the project's own Triton kernels,
forward and backward: ``causal_conv1d_silu`` (the causal depthwise conv + bias + SiLU) and
``gated_rms_norm`` (``rms_norm(y * silu(z)) * weight`` per group), each equal to the torch
composition the mixer uses otherwise. They run on CUDA tensors, or on CPU ones under the
Triton interpreter (``TRITON_INTERPRET=1`` set before triton is first imported).

Each is a torch custom op, so ``torch.compile`` keeps it in one graph. Both work on one tp
rank's channels and groups alone: nothing in either sums across ranks. Triton is optional:
importing this package registers the ops but never imports triton; calling them does.
"""

from __future__ import annotations

import math

from torch import Tensor

from mega_models.mixer_triton._conv import conv_silu
from mega_models.mixer_triton._norm import gated_norm

__all__ = ["causal_conv1d_silu", "gated_rms_norm"]


def causal_conv1d_silu(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``silu(causal_depthwise_conv1d(x, weight) + bias)`` along dim 0 (zero before position
    0): ``x [s, b, ch]`` or ``[s, b, g, c]`` with ``ch = g * c`` (any strides: the mixer passes
    its in_proj output's per-group slices as they are), ``weight [ch, k]`` (any ``k >= 1``),
    ``bias [ch]`` or None; output of x's shape, contiguous, in x's dtype.

    Accumulates in fp32 (fp64 for fp64 inputs). The backward recomputes the pre-activation
    rather than saving it, and sums the weight and bias gradients over fixed parts of the
    sequence, then over the parts: the same bits on every run.
    """
    if x.dim() not in (3, 4):
        raise ValueError(f"x {tuple(x.shape)} must be [s, b, ch] or [s, b, g, c]")
    channels = math.prod(x.shape[2:])
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(
            f"weight {tuple(weight.shape)} must be [channels, k] with the {channels} channels "
            f"of x {tuple(x.shape)} and k >= 1"
        )
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"bias {tuple(bias.shape)} must be ({channels},), one per channel of x")
    out: Tensor = conv_silu(x if x.dim() == 4 else x.unsqueeze(2), weight, bias)
    return out if x.dim() == 4 else out.squeeze(2)


def gated_rms_norm(y: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``rms_norm(y * silu(z), (w,), eps) * weight.view(g, w)``: ``y``, ``z`` ``[.., g, w]``
    (any strides), each group of ``w`` channels normalised on its own; ``weight [g * w]``;
    output contiguous, in the dtype torch gives that expression.

    Statistics in fp32 (fp64 for fp64 inputs); the forward saves only each row's rstd, the
    backward recomputes the gate and sums the weight gradient over fixed parts of the rows,
    then over the parts.
    """
    if y.dim() < 2 or y.shape != z.shape:
        raise ValueError(
            f"y {tuple(y.shape)} and z {tuple(z.shape)} must have one shape [.., g, w]"
        )
    g, w = y.shape[-2], y.shape[-1]
    if tuple(weight.shape) != (g * w,):
        raise ValueError(
            f"weight {tuple(weight.shape)} must be ({g * w},): g ({g}) x w ({w}) of y's last dims"
        )
    out: Tensor = gated_norm(y, z, weight, float(eps))[0]
    return out
