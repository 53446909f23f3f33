"""torch_ref.py's ``--liger`` pieces: Liger Kernel's public modules and functions (Triton, CUDA).

Imported only under ``--liger``; each function takes what torch_ref's plain path has at hand.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from liger_kernel.ops import LigerSiLUMulFunction
from liger_kernel.transformers import (
    LigerFusedLinearCrossEntropyLoss,
    LigerRMSNorm,
    liger_rotary_pos_emb,
)
from torch import Tensor, nn

_loss = LigerFusedLinearCrossEntropyLoss()  # mean over tokens, as F.cross_entropy


def rms_norm(hidden: int, eps: float) -> nn.Module:
    return LigerRMSNorm(hidden, eps=eps)  # type: ignore[no-any-return]


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """``q``, ``k`` ``[b, s, heads, d]``, ``cos``/``sin`` ``[s, 1, d/2]`` -> ``[b, heads, s, d]``.
    Liger takes Llama's duplicated ``cat(freqs, freqs)`` layout, ``cos``/``sin`` ``[s, d]``."""
    cos, sin = (torch.cat([t, t], dim=-1).squeeze(1) for t in (cos, sin))
    q, k = liger_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k


def swiglu(x: Tensor, gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` of ``x @ gate_up.T``, gate and up as two GEMMs (Llama's gate_proj
    and up_proj), so that Liger's kernel gets contiguous inputs."""
    gate, up = (F.linear(x, w) for w in gate_up.chunk(2))
    return LigerSiLUMulFunction.apply(gate, up)  # type: ignore[no-any-return]


@torch.compiler.disable  # Dynamo fails to trace its chunked addmm(out=, out_dtype=) (torch 2.11)
def linear_cross_entropy(weight: Tensor, x: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of ``x @ weight.T`` against ``targets``, logits never materialised."""
    return _loss(weight, x.reshape(-1, x.shape[-1]), targets.reshape(-1))  # type: ignore[no-any-return]
