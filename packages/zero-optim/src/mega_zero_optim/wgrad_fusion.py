"""The offer to a layer to add its weight gradient into ``main_grad`` itself.

With ``wgrad_into_main_grad`` (ZeRO-1, fp32 gradients),
:class:`~mega_zero_optim.ddp.DistributedDataParallel` offers every parameter that its layer
marks with :data:`WGRAD_FUSION_ATTR` the scale to add with, as :data:`MAIN_GRAD_ALPHA_ATTR`,
and skips its own add for it (Megatron's ``gradient_accumulation_fusion``; the layer side is
``mega_tp_layers.main_grad_fusion``).
"""

from __future__ import annotations

import torch

from mega_zero_optim.buffer import ParamAndGradBuffer
from mega_zero_optim.sharded_buffer import ShardedBuffer

__all__ = ["MAIN_GRAD_ALPHA_ATTR", "WGRAD_FUSION_ATTR", "offer_wgrad_fusion"]

#: a layer marks a parameter whose weight gradient it can add into ``main_grad`` itself; the
#: wrapper answers with the scale (see ``mega_tp_layers.main_grad_fusion``)
WGRAD_FUSION_ATTR = "mega_wgrad_fusion"
MAIN_GRAD_ALPHA_ATTR = "mega_main_grad_alpha"


def offer_wgrad_fusion(
    buffer: ParamAndGradBuffer | ShardedBuffer, index: int, grad_scale: float, offer: bool
) -> bool:
    """Let the layer of parameter ``index`` add its weight gradient into its fp32
    ``main_grad`` (persistent, zeroed every step) where ``offer`` and the layer can; True
    when offered. Otherwise any earlier wrapper's offer is withdrawn."""
    param = buffer.params[index]
    if offer and getattr(param, WGRAD_FUSION_ATTR, False) and buffer.grad_dtype == torch.float32:
        setattr(param, MAIN_GRAD_ALPHA_ATTR, grad_scale)
        return True
    if hasattr(param, MAIN_GRAD_ALPHA_ATTR):
        delattr(param, MAIN_GRAD_ALPHA_ATTR)
    return False
