"""GPTConfig: the shape of a GPT-style decoder, independent of how it is parallelised."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

__all__ = ["GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    """A Llama/GPT-style pre-norm decoder. Derived sizes are properties; nothing is parallel here."""

    vocab_size: int = 257
    """Tokens in the vocabulary (padded up to a multiple of tp inside the model)."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer layers."""
    num_attention_heads: int = 8
    """Query heads."""
    num_query_groups: int | None = None
    """Key/value heads (GQA; 1 = MQA); None means one per query head (MHA)."""
    ffn_hidden_size: int | None = None
    """Inner width of the MLP; None means 4 * hidden (gelu) or 8/3 * hidden rounded to 64 (swiglu)."""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """Normalisation before attention, before the MLP and at the end."""
    norm_eps: float = 1e-5
    """Epsilon of the norms."""
    activation: Literal["swiglu", "gelu"] = "swiglu"
    """MLP activation; swiglu uses a gated first projection of twice the width."""
    position: Literal["rope", "learned"] = "rope"
    """Rotary position embedding in attention, or a learned absolute table added to the input."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    max_seq_len: int = 2048
    """Longest sequence (size of the learned position table; bound for RoPE caches)."""
    qk_norm: bool = False
    """RMS-normalise queries and keys per head before attention."""
    tie_embeddings: bool = False
    """Share the input embedding with the output layer."""
    add_bias: bool = False
    """Biases in the linear layers."""
    hidden_dropout: float = 0.0
    """Dropout on the attention and MLP outputs before the residual add."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities."""
    init_std: float = 0.02
    """Standard deviation of the normal init; output projections use init_std / sqrt(2 * num_layers)."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); choose a multiple of the head count"
            )
        groups = self.kv_heads
        if groups < 1 or self.num_attention_heads % groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not divisible by "
                f"num_query_groups ({groups}); choose a divisor of the head count"
            )
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            raise ValueError(f"ffn_hidden_size ({self.ffn_hidden_size}) must be positive or None")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"norm ({self.norm!r}) must be 'rmsnorm' or 'layernorm'")
        if self.activation not in ("swiglu", "gelu"):
            raise ValueError(f"activation ({self.activation!r}) must be 'swiglu' or 'gelu'")
        if self.position not in ("rope", "learned"):
            raise ValueError(f"position ({self.position!r}) must be 'rope' or 'learned'")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(
                f"head dim ({self.head_dim}) must be even for rope; change hidden_size or heads"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} ({p}) must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads (num_query_groups, or one per query head)."""
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def ffn_size(self) -> int:
        """The MLP inner width actually used."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.activation == "gelu":
            return 4 * self.hidden_size
        return (int(8 * self.hidden_size / 3) + 63) // 64 * 64

    def replace(self, **changes: Any) -> GPTConfig:
        """A copy with some fields changed (validated again)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(
                f"GPTConfig has no field {', '.join(unknown)}; known fields: {', '.join(sorted(known))}"
            )
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return GPTConfig(**values)
