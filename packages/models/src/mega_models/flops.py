"""Model FLOPs per token, counted from the config exactly as the model is built."""

from __future__ import annotations

from mega_models.config import GPTConfig
from mega_moe import moe_activated_params

__all__ = [
    "activated_matmul_params",
    "attention_norm_params",
    "attention_params",
    "ffn_params",
    "forward_flops_per_token",
    "matmul_params",
    "model_flops_per_token",
    "moe_layer_params",
    "replicated_attention_params",
]


def attention_params(config: GPTConfig) -> int:
    """Matmul weights of one attention layer: the fused QKV and the output projection, or
    MLA's q (down and up, or one projection), kv down (latent + rope key), kv up and output."""
    c, h, n = config, config.hidden_size, config.num_attention_heads
    if c.attention == "mla":
        assert c.kv_lora_rank is not None and c.qk_rope_head_dim is not None
        q_out = n * c.head_dim
        q = h * q_out if c.q_lora_rank is None else c.q_lora_rank * (h + q_out)
        kv_down = h * (c.kv_lora_rank + c.qk_rope_head_dim)
        kv_up = c.kv_lora_rank * n * (c.head_dim - c.qk_rope_head_dim + c.v_dim)
        return q + kv_down + kv_up + n * c.v_dim * h
    hd = c.head_dim
    qkv = h * (n + 2 * c.kv_heads) * hd
    return qkv + n * hd * h


def attention_norm_params(config: GPTConfig) -> int:
    """Norm weights inside one attention layer: MLA's latent norms, or QK-norm's two
    per-head-dim weights (0 for standard attention without QK-norm)."""
    c = config
    if c.attention != "mla":
        return 2 * c.head_dim if c.qk_norm else 0
    assert c.kv_lora_rank is not None
    return c.kv_lora_rank + (c.q_lora_rank or 0)


def replicated_attention_params(config: GPTConfig) -> int:
    """Weights of one attention layer that every tp rank holds whole: MLA's q and kv
    down-projections and latent norms (0 for standard attention)."""
    c = config
    if c.attention != "mla":
        return 0
    assert c.kv_lora_rank is not None and c.qk_rope_head_dim is not None
    down = c.hidden_size * ((c.q_lora_rank or 0) + c.kv_lora_rank + c.qk_rope_head_dim)
    return down + attention_norm_params(c)


def ffn_params(config: GPTConfig, ffn: int) -> int:
    """Matmul weights of one MLP of inner width ``ffn`` (gated: three matrices)."""
    return (3 if config.activation == "swiglu" else 2) * config.hidden_size * ffn


def moe_layer_params(config: GPTConfig) -> int:
    """Matmul weights of one MoE layer: router, every routed expert, shared experts."""
    h, e = config.hidden_size, config.num_experts
    routed = e * ffn_params(config, config.moe_ffn_size)
    return h * e + routed + ffn_params(config, config.moe_shared_expert_size)


def matmul_params(config: GPTConfig) -> int:
    """Parameters that take part in matmuls: every linear weight plus the output layer.

    On MoE layers every routed expert counts (the weights the model holds); see
    :func:`activated_matmul_params` for the ones a token passes through. The input
    embedding is a lookup, not a matmul (it counts once more only when tied).
    """
    moe = len(config.moe_layers)
    dense = config.num_layers - moe
    per_layer = dense * ffn_params(config, config.ffn_size)
    if moe:
        per_layer += moe * moe_layer_params(config)
    attention = config.num_layers * attention_params(config)
    return attention + per_layer + config.hidden_size * config.vocab_size


def activated_matmul_params(config: GPTConfig) -> int:
    """Matmul weights one token passes through: as :func:`matmul_params`, but on MoE layers
    only the router, its top-k routed experts and the shared experts."""
    moe = len(config.moe_layers)
    total = matmul_params(config)
    if moe == 0:
        return total
    activated = moe_activated_params(config.hidden_size, config.moe_config())
    return total - moe * (moe_layer_params(config) - activated)


def forward_flops_per_token(config: GPTConfig, seq_len: int) -> float:
    """Forward FLOPs per token: 2 per activated matmul weight, plus QK^T and AV over s x s.

    Attention is counted over the full square (the PaLM/Megatron convention the peers use),
    so causal masking is not discounted: ``2 s n (d_qk + d_v)`` per layer (MLA's qk head
    is ``qk_nope + qk_rope`` wide, its value ``v_head_dim``). MoE layers count only the
    experts a token is routed to (top-k, without dropping or padding), the router and the
    shared experts.
    """
    dims = config.head_dim + config.v_dim
    attn = 2 * seq_len * config.num_attention_heads * dims * config.num_layers
    return 2.0 * activated_matmul_params(config) + attn


def model_flops_per_token(config: GPTConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token (3 x forward): 6 N + 12 L h s for MHA (N activated)."""
    return 3.0 * forward_flops_per_token(config, seq_len)
