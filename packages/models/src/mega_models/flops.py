"""Model FLOPs per token, counted from the config exactly as the model is built."""

from __future__ import annotations

from mega_models.config import GPTConfig

__all__ = ["forward_flops_per_token", "matmul_params", "model_flops_per_token"]


def matmul_params(config: GPTConfig) -> int:
    """Parameters that take part in matmuls: every linear weight plus the output layer.

    The input embedding is a lookup, not a matmul (it counts once more only when tied).
    """
    h, hd = config.hidden_size, config.head_dim
    qkv = h * (config.num_attention_heads + 2 * config.kv_heads) * hd
    proj = config.num_attention_heads * hd * h
    ffn = config.ffn_size
    mlp = (3 if config.activation == "swiglu" else 2) * h * ffn
    return config.num_layers * (qkv + proj + mlp) + h * config.vocab_size


def forward_flops_per_token(config: GPTConfig, seq_len: int) -> float:
    """Forward FLOPs per token: 2 per matmul weight, plus QK^T and AV over the full s x s.

    Attention is counted over the full square (the PaLM/Megatron convention the peers use),
    so causal masking is not discounted.
    """
    attn = 2 * 2 * seq_len * config.num_attention_heads * config.head_dim * config.num_layers
    return 2.0 * matmul_params(config) + attn


def model_flops_per_token(config: GPTConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token (3 x forward): 6 N + 12 L h s for MHA."""
    return 3.0 * forward_flops_per_token(config, seq_len)
