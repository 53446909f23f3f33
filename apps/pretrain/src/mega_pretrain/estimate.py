"""What ``--dry-run`` prints: parameters, memory per rank and FLOPs, without building anything."""

from __future__ import annotations

from dataclasses import dataclass

from mega_pretrain.plan import Plan
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


def estimate(plan: Plan) -> Estimate:
    """Estimate of one rank's memory: weights, fp32 gradients, Adam state, activations.

    Activations follow Korthikanti et al. (flash attention, so no s^2 term): about
    ``34 * s * b * h / tp`` bytes per layer in 16-bit with sequence parallelism and
    ``s * b * h * (10 + 24 / tp)`` without; full recompute keeps only each layer's input
    (``2 * s * b * h / tp``). 1F1B keeps up to ``pp`` micro-batches in flight on stage 0.
    MoE: routed experts are split over ep x etp (not tp) and their optimizer state over the
    expert-data-parallel ranks; an MoE layer's activations are counted like a dense one's.
    """
    config, model, spec = plan.config, plan.model, plan.spec
    p, t, parallel = config.parallel, config.train, plan.parallel
    total = spec.total_params(model)
    layers_per_stage = max(plan.rank_layers)  # the busiest pp rank's virtual stages
    dense_rank, expert_rank = spec.params_per_rank(model, parallel, layers_per_stage)
    per_rank = dense_rank + expert_rank
    precision = resolve_precision(t.precision)
    width = _BYTES[precision]
    weights = per_rank * width
    grads = per_rank * 4
    master = 0 if precision == "fp32" else 4
    # dense state is sharded over dp x cp; expert state over the expert-data-parallel ranks
    dp, etp = plan.dp, parallel.expert_tp
    shards = dp * p.cp if p.distributed_optimizer else 1
    expert_shards = max(1, dp * p.cp * p.tp // (p.ep * etp)) if p.distributed_optimizer else 1
    optimizer = dense_rank * (master + 8) // shards + expert_rank * (master + 8) // expert_shards
    s, b, h = plan.local_seq_len, t.micro_batch_size, model.hidden_size
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
        flops_per_token=plan.flops_per_token(),
    )  # fmt: skip
