"""What ``--dry-run`` prints: parameters, memory per rank and FLOPs, without building anything."""

from __future__ import annotations

from dataclasses import dataclass

from mega_models import (
    GPTConfig,
    HybridConfig,
    hybrid_flops_per_token,
    hybrid_matmul_params,
    matmul_params,
    model_flops_per_token,
)
from mega_pretrain.config import TrainerConfig
from mega_pretrain.runtime import resolve_precision

__all__ = ["Estimate", "estimate"]

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Estimate:
    """Sizes per rank (the busiest one: a first/last pipeline stage), in bytes."""

    total_params: int
    params_per_rank: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    flops_per_token: float

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations


def _mamba_extra_params(m: HybridConfig) -> int:
    """Per Mamba layer: the depthwise convolution, dt bias, A, D and the gated norm."""
    conv = m.mamba_inner + 2 * m.mamba_num_groups * m.mamba_state_dim
    per_layer = conv * (m.mamba_conv_width + int(m.mamba_conv_bias))
    per_layer += 3 * m.mamba_num_heads + m.mamba_inner
    return m.pattern.count("M") * per_layer


def _total_params(m: GPTConfig) -> int:
    embedding = m.vocab_size * m.hidden_size
    norms_per_layer = 1 if isinstance(m, HybridConfig) else 2  # hybrid layers: one pre-norm
    norms = (norms_per_layer * m.num_layers + 1) * m.hidden_size
    norms *= 2 if m.norm == "layernorm" else 1
    positions = m.max_seq_len * m.hidden_size if m.position == "learned" else 0
    output = 0 if m.tie_embeddings else m.vocab_size * m.hidden_size
    matmuls = matmul_params(m)
    if isinstance(m, HybridConfig):
        matmuls = hybrid_matmul_params(m) + _mamba_extra_params(m)
    return matmuls - m.vocab_size * m.hidden_size + embedding + output + norms + positions


def _routed_expert_params(m: GPTConfig) -> int:
    """Weights of every routed expert of every MoE layer (split over ep x etp, not tp)."""
    if not m.is_moe:
        return 0
    per_expert = (3 if m.activation == "swiglu" else 2) * m.hidden_size * m.moe_ffn_size
    return len(m.moe_layers) * m.num_experts * per_expert


def estimate(config: TrainerConfig, model: GPTConfig, dp: int) -> Estimate:
    """Estimate of one rank's memory: weights, fp32 gradients, Adam state, activations.

    Activations follow Korthikanti et al. (flash attention, so no s^2 term): about
    ``34 * s * b * h / tp`` bytes per layer in 16-bit with sequence parallelism and
    ``s * b * h * (10 + 24 / tp)`` without; full recompute keeps only each layer's input
    (``2 * s * b * h / tp``). 1F1B keeps up to ``pp`` micro-batches in flight on stage 0.
    MoE: routed experts are split over ep x etp (not tp) and their optimizer state over the
    expert-data-parallel ranks; an MoE layer's activations are counted like a dense one's.
    """
    p, t = config.parallel, config.train
    total = _total_params(model)
    experts = _routed_expert_params(model)
    vocab = model.vocab_size * model.hidden_size
    matrices = 1 if model.tie_embeddings else 2  # input embedding and output layer
    per_layer = (total - experts - matrices * vocab) / model.num_layers
    # the busiest pp rank: its virtual stages' layers (an even split unless pp_layers is given)
    layers_per_stage = model.num_layers / p.pp
    if p.pp_layers:
        chunks = p.vpp or 1
        layers_per_stage = max(
            sum(p.pp_layers[c * p.pp + r] for c in range(chunks)) for r in range(p.pp)
        )
    # the busiest stage holds the embedding or the output layer (a tied copy too), both at pp 1
    embed = vocab * (matrices if p.pp == 1 else 1)
    dense_rank = int((per_layer * layers_per_stage + embed) / p.tp)
    etp = p.etp if p.etp is not None else p.tp
    expert_rank = int(experts / p.pp / (p.ep * etp))
    per_rank = dense_rank + expert_rank
    precision = resolve_precision(t.precision)
    width = _BYTES[precision]
    weights = per_rank * width
    grads = per_rank * 4
    master = 0 if precision == "fp32" else 4
    # dense state is sharded over dp x cp; expert state over the expert-data-parallel ranks
    shards = dp * p.cp if p.distributed_optimizer else 1
    expert_shards = max(1, dp * p.cp * p.tp // (p.ep * etp)) if p.distributed_optimizer else 1
    optimizer = dense_rank * (master + 8) // shards + expert_rank * (master + 8) // expert_shards
    s, b, h = t.seq_len // p.cp, t.micro_batch_size, model.hidden_size
    if t.recompute == "full":
        layer_act = 2 * s * b * h / p.tp
    elif p.sequence_parallel:
        layer_act = 34 * s * b * h / p.tp
    else:
        layer_act = s * b * h * (10 + 24 / p.tp)
    act_scale = (width / 2) if precision != "fp32" else 2.0
    in_flight = p.pp if p.pp > 1 else 1
    activations = int(layer_act * act_scale * layers_per_stage * in_flight)
    logits = int(s * b * model.vocab_size / p.tp * 4 * 2)  # fp32 logits and their gradient
    return Estimate(
        total_params=total, params_per_rank=per_rank, weights=weights, grads=grads,
        optimizer=optimizer, activations=activations + logits,
        flops_per_token=(
            hybrid_flops_per_token(model, t.seq_len)
            if isinstance(model, HybridConfig)
            else model_flops_per_token(model, t.seq_len)
        ),
    )  # fmt: skip
