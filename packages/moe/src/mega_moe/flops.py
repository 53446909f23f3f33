"""FLOPs of an MoE layer per token, counting only the experts a token activates."""

from __future__ import annotations

from mega_moe.config import MoEConfig

__all__ = ["moe_activated_params", "moe_flops_per_token"]


def moe_activated_params(hidden_size: int, config: MoEConfig) -> int:
    """Matmul weights one token passes through: router, its top-k experts, shared experts."""
    h, c = hidden_size, config
    per_ffn = (3 if c.gated else 2) * h  # weight1 (gate and up, or one) and weight2
    router = h * c.num_experts
    return router + c.top_k * per_ffn * c.ffn_hidden_size + per_ffn * c.shared_ffn_size


def moe_flops_per_token(hidden_size: int, config: MoEConfig, *, backward: bool = False) -> float:
    """Forward FLOPs per token of one MoE layer: 2 per activated matmul weight.

    With ``backward=True``, forward + backward (3x forward), as MFU counts it. Dropped
    tokens, padding and the element-wise work are not counted.
    """
    forward = 2.0 * moe_activated_params(hidden_size, config)
    return 3.0 * forward if backward else forward
