"""What multi-token prediction adds to the model's parameters and FLOPs. Pure arithmetic.

Each of the D depths holds one transformer layer of the kind of the decoder's last layer,
``eh_proj`` (2h x h) and three norms (enorm, hnorm, its final norm) beside the layer's
two; it reuses the embedding and the output layer, so those add FLOPs (the head's matmul
runs once more per depth) but no parameters.
"""

from __future__ import annotations

from mega_models.config import GPTConfig
from mega_models.flops import (
    attention_norm_params,
    attention_params,
    ffn_params,
    forward_flops_per_token,
    moe_layer_params,
)
from mega_moe import moe_activated_params

__all__ = ["mtp_flops_per_token", "mtp_matmul_params", "mtp_norm_params"]


def _mlp_params(config: GPTConfig, *, activated: bool) -> int:
    """The MTP layer's MLP weights: every expert (held) or those a token passes (activated)."""
    if not config.is_moe_layer(config.num_layers - 1):
        return ffn_params(config, config.ffn_size)
    if activated:
        return moe_activated_params(config.hidden_size, config.moe_config())
    return moe_layer_params(config)


def mtp_matmul_params(config: GPTConfig) -> int:
    """Matmul weights the D depths hold (layers, every routed expert, ``eh_proj``)."""
    h = config.hidden_size
    per_depth = attention_params(config) + _mlp_params(config, activated=False) + 2 * h * h
    return config.mtp_num_layers * per_depth


def mtp_norm_params(config: GPTConfig) -> int:
    """Norm parameters of the D depths: five norms each (weight, and bias for layernorm),
    and the latent norms of an MLA layer."""
    per_norm = config.hidden_size * (2 if config.norm == "layernorm" else 1)
    return config.mtp_num_layers * (5 * per_norm + attention_norm_params(config))


def mtp_flops_per_token(config: GPTConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token of the D depths (3 x forward), in the convention of
    :func:`~mega_models.flops.forward_flops_per_token`: 2 per activated matmul weight (the
    layer, ``eh_proj``, the shared output layer) plus one layer's attention over s x s."""
    if config.mtp_num_layers == 0:
        return 0.0
    h = config.hidden_size
    activated = attention_params(config) + _mlp_params(config, activated=True)
    matmuls = activated + 2 * h * h + h * config.vocab_size
    # the s-dependent part of one decoder layer (QK^T and AV), whatever attention it has
    scores = (forward_flops_per_token(config, seq_len) - forward_flops_per_token(config, 0)) / (
        config.num_layers
    )
    return 3.0 * config.mtp_num_layers * (2.0 * matmuls + scores)
