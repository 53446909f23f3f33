"""Named model sizes."""

from __future__ import annotations

from mega_models.config import GPTConfig

__all__ = ["MODEL_SIZES", "model_config"]

MODEL_SIZES: dict[str, GPTConfig] = {
    # CPU, seconds: the contract tests' and the default trainer's model (vocab not divisible by tp).
    "tiny": GPTConfig(
        vocab_size=257, hidden_size=64, num_layers=8, num_attention_heads=8,
        num_query_groups=4, ffn_hidden_size=128, max_seq_len=256,
    ),
    "125m": GPTConfig(
        vocab_size=50304, hidden_size=768, num_layers=12, num_attention_heads=12,
        ffn_hidden_size=2048, max_seq_len=2048, tie_embeddings=True,
    ),
    "1b": GPTConfig(
        vocab_size=32000, hidden_size=2048, num_layers=22, num_attention_heads=16,
        num_query_groups=4, ffn_hidden_size=5632, max_seq_len=2048,
    ),
    # The shape the peers were measured on (ANCHORS.md): MHA, 24 layers, seq 2048.
    "1b-bench": GPTConfig(
        vocab_size=32000, hidden_size=2048, num_layers=24, num_attention_heads=16,
        ffn_hidden_size=5632, max_seq_len=2048,
    ),
    # Llama-3-8B shape.
    "8b": GPTConfig(
        vocab_size=128256, hidden_size=4096, num_layers=32, num_attention_heads=32,
        num_query_groups=8, ffn_hidden_size=14336, max_seq_len=8192, rope_theta=500000.0,
    ),
}  # fmt: skip


def model_config(name: str) -> GPTConfig:
    """The registered config called ``name``."""
    try:
        return MODEL_SIZES[name]
    except KeyError:
        raise ValueError(
            f"unknown model size {name!r}; known sizes: {', '.join(MODEL_SIZES)}"
        ) from None
