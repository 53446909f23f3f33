"""Named hybrid model sizes."""

from __future__ import annotations

import math

from mega_models.hybrid_config import HybridConfig

__all__ = ["HYBRID_SIZES", "hybrid_config"]

HYBRID_SIZES: dict[str, HybridConfig] = {
    # CPU, seconds: the contract tests' model (vocab not divisible by tp, 2 Mamba groups).
    "hybrid-tiny": HybridConfig(
        vocab_size=257, hidden_size=64, num_layers=8, pattern="M*M-M*M-",
        num_attention_heads=8, num_query_groups=4, ffn_hidden_size=128, max_seq_len=256,
        mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2, mamba_chunk_size=16,
    ),
    # CPU MoE: hybrid-tiny with its two MLP layers made Mixtral-style mixtures of experts
    # (8 experts of FFN 64, top-2: top-k logits, then softmax; switch aux loss).
    "hybrid-moe-tiny": HybridConfig(
        vocab_size=257, hidden_size=64, num_layers=8, pattern="M*MEM*ME",
        num_attention_heads=8, num_query_groups=4, ffn_hidden_size=128, max_seq_len=256,
        mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2, mamba_chunk_size=16,
        num_experts=8, moe_top_k=2, moe_ffn_hidden_size=64, moe_aux_loss_coeff=1e-2,
    ),
    # Beside the GPT "1b" size (same width, vocab, attention and MLP shapes): 15 Mamba,
    # 5 attention and 15 MLP layers, ~1.0B parameters besides the embeddings.
    "hybrid-1b": HybridConfig(
        vocab_size=32000, hidden_size=2048, num_layers=35, pattern="M-M-M*-" * 5,
        num_attention_heads=16, num_query_groups=4, ffn_hidden_size=5632, max_seq_len=2048,
        mamba_state_dim=128, mamba_head_dim=64, mamba_num_groups=8, mamba_chunk_size=128,
    ),
    # CPU Nemotron-H (NemotronHForCausalLM's computation): attention without positions,
    # squared-ReLU MLPs without gate, dt clamped to (dt_min, inf) as transformers does.
    "nemotron-h-tiny": HybridConfig(
        vocab_size=257, hidden_size=64, num_layers=8, pattern="M-M*-M*-",
        num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128, max_seq_len=256,
        activation="relu2", position="none", mamba_state_dim=16, mamba_head_dim=16,
        mamba_num_groups=2, mamba_chunk_size=16, mamba_dt_limit=(0.001, math.inf),
    ),
    # Nemotron-H-8B's shapes at hybrid-1b's width, vocabulary and depth class: the first
    # half of its 52-layer pattern (12 Mamba, 2 attention, 12 MLP layers), head dim 128
    # with 4:1 GQA, FFN 5.25 h, Mamba heads of 64 and 8 groups of state 128; ~0.9B
    # parameters besides the embeddings.
    "nemotron-h-1b": HybridConfig(
        vocab_size=32000, hidden_size=2048, num_layers=26, pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-",
        num_attention_heads=16, num_query_groups=4, ffn_hidden_size=10752, max_seq_len=8192,
        activation="relu2", position="none", mamba_state_dim=128, mamba_head_dim=64,
        mamba_num_groups=8, mamba_chunk_size=128, mamba_dt_limit=(0.001, math.inf),
    ),
}  # fmt: skip


def hybrid_config(name: str) -> HybridConfig:
    """The registered hybrid config called ``name``."""
    try:
        return HYBRID_SIZES[name]
    except KeyError:
        raise ValueError(
            f"unknown hybrid size {name!r}; known sizes: {', '.join(HYBRID_SIZES)}"
        ) from None
