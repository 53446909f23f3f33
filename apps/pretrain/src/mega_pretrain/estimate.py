"""What ``--dry-run`` prints: parameters, memory per rank and FLOPs, without building anything."""

from __future__ import annotations

from dataclasses import dataclass

from mega_models import GPTConfig, matmul_params, model_flops_per_token
from mega_pretrain.config import TrainerConfig

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


def _total_params(m: GPTConfig) -> int:
    embedding = m.vocab_size * m.hidden_size
    norms = (2 * m.num_layers + 1) * m.hidden_size * (2 if m.norm == "layernorm" else 1)
    positions = m.max_seq_len * m.hidden_size if m.position == "learned" else 0
    output = 0 if m.tie_embeddings else m.vocab_size * m.hidden_size
    return matmul_params(m) - m.vocab_size * m.hidden_size + embedding + output + norms + positions


def estimate(config: TrainerConfig, model: GPTConfig, dp: int) -> Estimate:
    """Estimate of one rank's memory: weights, fp32 gradients, Adam state, activations.

    Activations follow Korthikanti et al. (flash attention, so no s^2 term): about
    ``34 * s * b * h / tp`` bytes per layer in 16-bit with sequence parallelism and
    ``s * b * h * (10 + 24 / tp)`` without; full recompute keeps only each layer's input
    (``2 * s * b * h / tp``). 1F1B keeps up to ``pp`` micro-batches in flight on stage 0.
    """
    p, t = config.parallel, config.train
    total = _total_params(model)
    per_layer = (total - 2 * model.vocab_size * model.hidden_size) / model.num_layers
    layers_per_stage = model.num_layers / p.pp
    embed = model.vocab_size * model.hidden_size
    per_rank = int((per_layer * layers_per_stage + embed) / p.tp)
    width = _BYTES[t.precision]
    weights = per_rank * width
    grads = per_rank * 4
    master = 0 if t.precision == "fp32" else 4
    shards = dp * p.cp if p.distributed_optimizer else 1
    optimizer = per_rank * (master + 8) // shards
    s, b, h = t.seq_len // p.cp, t.micro_batch_size, model.hidden_size
    if t.recompute == "full":
        layer_act = 2 * s * b * h / p.tp
    elif p.sequence_parallel:
        layer_act = 34 * s * b * h / p.tp
    else:
        layer_act = s * b * h * (10 + 24 / p.tp)
    act_scale = (width / 2) if t.precision != "fp32" else 2.0
    in_flight = p.pp if p.pp > 1 else 1
    activations = int(layer_act * act_scale * layers_per_stage * in_flight)
    logits = int(s * b * model.vocab_size / p.tp * 4 * 2)  # fp32 logits and their gradient
    return Estimate(
        total_params=total, params_per_rank=per_rank, weights=weights, grads=grads,
        optimizer=optimizer, activations=activations + logits,
        flops_per_token=model_flops_per_token(model, t.seq_len),
    )  # fmt: skip
