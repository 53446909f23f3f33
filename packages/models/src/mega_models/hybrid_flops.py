"""Model FLOPs per token of a hybrid model, counted from the config as the model is built."""

from __future__ import annotations

import math

from mega_models.flops import attention_params, ffn_params, moe_layer_params
from mega_models.hybrid_config import HybridConfig
from mega_moe import moe_activated_params

__all__ = [
    "hybrid_activated_matmul_params",
    "hybrid_flops_per_token",
    "hybrid_matmul_params",
    "ssd_flops_per_token",
]


def hybrid_matmul_params(config: HybridConfig) -> int:
    """Weights that take part in matmuls: every layer's linear weights plus the output layer.

    A Mamba layer has ``in_proj`` (``h x (2 d_inner + 2 g N + heads)``) and ``out_proj``
    (``d_inner x h``); attention and MLP layers are GPT's; an ``E`` layer counts its router,
    every routed expert and the shared experts (the weights the model holds; see
    :func:`hybrid_activated_matmul_params` for those a token passes through). The input
    embedding is a lookup.
    """
    c = config
    h = c.hidden_size
    mamba = h * (2 * c.mamba_inner + 2 * c.mamba_num_groups * c.mamba_state_dim
                 + c.mamba_num_heads) + c.mamba_inner * h  # fmt: skip
    return (c.count("M") * mamba + c.count("*") * attention_params(c)
            + c.count("-") * ffn_params(c, c.ffn_size) + c.count("E") * moe_layer_params(c)
            + h * c.vocab_size)  # fmt: skip


def hybrid_activated_matmul_params(config: HybridConfig) -> int:
    """Matmul weights one token passes through: as :func:`hybrid_matmul_params`, but an
    ``E`` layer counts only its router, the top-k routed experts and the shared experts."""
    c = config
    total = hybrid_matmul_params(c)
    if not c.count("E"):
        return total
    activated = moe_activated_params(c.hidden_size, c.moe_config())
    return total - c.count("E") * (moe_layer_params(c) - activated)


def ssd_flops_per_token(config: HybridConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one SSD scan, as the chunked algorithm computes it.

    With chunk ``Q``, ``g`` groups of ``N`` state channels, ``H`` heads of ``P`` channels
    and ``K = ceil(seq_len / Q)`` chunks, counting each multiply-add as 2 and, like
    attention, full squares (no causal discount)::

        2 Q g N        C.B scores inside the chunk
      + 2 Q H P        scores x (dt x) inside the chunk
      + 2 H P N        the state each chunk leaves
      + 2 K H P N / Q  the states entering each chunk (a K x K decay matrix per head)
      + 2 H P N        entering state x C
    """
    c = config
    q, g, n = c.mamba_chunk_size, c.mamba_num_groups, c.mamba_state_dim
    heads, p = c.mamba_num_heads, c.mamba_head_dim
    chunks = math.ceil(seq_len / q)
    return (
        2.0 * q * g * n
        + 2.0 * q * heads * p
        + 4.0 * heads * p * n
        + 2.0 * chunks * heads * p * n / q
    )


def hybrid_flops_per_token(config: HybridConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token (3 x forward), for MFU.

    Forward = ``2 * hybrid_activated_matmul_params`` (on ``E`` layers only the router, the
    top-k routed experts and the shared experts, as for GPT; no dropping or padding) + per
    attention layer ``4 s heads head_dim`` (QK^T and AV over the full s x s, as for GPT) +
    per Mamba layer the SSD (:func:`ssd_flops_per_token`) and the depthwise conv
    (``2 d_conv (d_inner + 2 g N)``). Element-wise work (norms, gates, softplus, exp of
    the decays, the routers' softmax and the weighted combine) is not counted.
    """
    c = config
    attention = 4.0 * seq_len * c.num_attention_heads * c.head_dim
    conv = 2.0 * c.mamba_conv_width * (c.mamba_inner + 2 * c.mamba_num_groups * c.mamba_state_dim)
    mamba = ssd_flops_per_token(c, seq_len) + conv
    forward = (2.0 * hybrid_activated_matmul_params(c) + c.count("*") * attention
               + c.count("M") * mamba)  # fmt: skip
    return 3.0 * forward
