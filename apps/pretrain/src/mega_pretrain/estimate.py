"""What ``--dry-run`` prints: parameters, memory per rank and FLOPs, without building anything."""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from mega_pretrain.plan import Plan
from mega_pretrain.runtime import resolve_precision

__all__ = ["Estimate", "estimate", "in_flight_bytes"]

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
    in_flight: int = 0
    """ZeRO-2/3 (``parallel.sharding``): what comes and goes during a step beside the shards
    above: the full gradients of the buckets being reduced and, for ZeRO-3, the gathered
    parameters (the root unit, the layer in use and the one prefetched)."""
    host: int = 0
    """``parallel.optimizer_offload``: the host memory of the fp32 masters and Adam moments
    (and the masters' gradients), which :attr:`optimizer` then leaves off the device."""
    fp8_cache: int = 0
    """``train.fp8_weight_cache``: each transformer layer's fp8 weights and their transposes,
    two bytes a parameter of the rank's layers (routed experts excepted; the layers' norms
    are counted too, a fraction of a percent). ``model.moe_expert_fp8``: the same two bytes
    for every routed expert parameter of the rank."""

    @property
    def total(self) -> int:
        return (
            self.weights + self.grads + self.optimizer + self.activations + self.in_flight
            + self.fp8_cache
        )  # fmt: skip


def estimate(plan: Plan) -> Estimate:
    """Estimate of one rank's memory: weights, fp32 gradients, Adam state, activations.

    Activations follow Korthikanti et al. (flash attention, so no s^2 term): about
    ``34 * s * b * h / tp`` bytes per layer in 16-bit with sequence parallelism and
    ``s * b * h * (10 + 24 / tp)`` without; full recompute keeps only each layer's input
    (``2 * s * b * h / tp``). 1F1B keeps up to ``pp`` micro-batches in flight on stage 0.
    MoE: routed experts are split over ep x etp (not tp) and their optimizer state over the
    expert-data-parallel ranks; an MoE layer's activations are counted like a dense one's.

    ``parallel.sharding``: bytes per parameter with bf16 weights, fp32 gradients and AdamW
    are ``2 + 4 + 12/s`` for ``optimizer`` (ZeRO-1), ``2 + 16/s`` for ``gradients`` and
    ``18/s`` for ``parameters`` (``s``: the ranks sharing the state, dp x cp for dense
    weights), plus :attr:`Estimate.in_flight` (see :func:`in_flight_bytes`).
    ``parallel.optimizer_offload`` moves the ``(4 + 8)/s`` of masters and moments (and a
    4/s copy of their gradients) to :attr:`Estimate.host`. ``train.optimizer_moment_dtype
    bf16`` stores the two moments in 2 bytes each: ``(4 + 4)/s`` of optimizer state.
    """
    config, model, spec = plan.config, plan.model, plan.spec
    p, t, parallel = config.parallel, config.train, plan.parallel
    total = spec.total_params(model)
    layers_per_stage = max(plan.rank_layers)  # the busiest pp rank's virtual stages
    dense_rank, expert_rank = spec.params_per_rank(model, parallel, layers_per_stage)
    per_rank = dense_rank + expert_rank
    precision = resolve_precision(t.precision)
    width = _BYTES[precision]
    master = 0 if precision == "fp32" else 4
    # dense state is sharded over dp x cp; expert state over the expert-data-parallel ranks
    dp, etp = plan.dp, parallel.expert_tp
    shards = (p.dp_shard or dp) * p.cp if p.distributed_optimizer else 1  # HSDP: the shard group
    expert_shards = max(1, dp * p.cp * p.tp // (p.ep * etp)) if p.distributed_optimizer else 1
    if p.dp_shard:  # HSDP: experts shard over edp_shard = edp / gcd(edp, dp_replicate)
        expert_shards //= gcd(expert_shards, dp // p.dp_shard)
    stage = p.zero_stage

    def sharded(each: int, kinds: tuple[str, ...]) -> int:
        """Bytes of a tensor of ``each`` bytes per parameter: a shard under the stages in
        ``kinds``, else whole."""
        dense = dense_rank * each // (shards if stage in kinds else 1)
        return dense + expert_rank * each // (expert_shards if stage in kinds else 1)

    weights = sharded(width, ("parameters",))
    grads = sharded(4, ("gradients", "parameters"))
    state = master + (4 if t.optimizer_moment_dtype == "bf16" else 8)  # + both Adam moments
    optimizer = dense_rank * state // shards + expert_rank * state // expert_shards
    host = 0
    if p.optimizer_offload:  # masters, moments and the masters' fp32 gradients on the host
        host = optimizer + (dense_rank * 4 // shards + expert_rank * 4 // expert_shards)
        optimizer = 0
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
    fp8_cache = 0
    if t.fp8 and t.fp8_weight_cache:  # the layers' dense parameters (the embedding excepted)
        layer_params = dense_rank - spec.params_per_rank(model, parallel, 0)[0]
        fp8_cache = 2 * layer_params
    if model.moe_expert_fp8:  # the local experts' fp8 weights, by row and transposed
        fp8_cache += 2 * expert_rank
    return Estimate(
        total_params=total, params_per_rank=per_rank, weights=weights, grads=grads,
        optimizer=optimizer, activations=activations + logits,
        flops_per_token=plan.flops_per_token(), in_flight=in_flight_bytes(plan, width),
        host=host, fp8_cache=fp8_cache,
    )  # fmt: skip


def in_flight_bytes(plan: Plan, width: int) -> int:
    """ZeRO-2/3's memory beside the shards, at its peak (0 for ZeRO-1).

    Gradients: a bucket's full gradients live from its first gradient until its
    reduce-scatter is done, and at most 3 are alive (2 reducing, 1 accumulating), each
    ``parallel.bucket_size`` elements or one whole parameter larger than that (the
    embedding), in fp32. ZeRO-3 also holds the root unit whole for the step (the
    embedding and, untied at pp 1, the output layer, in ``width`` bytes) and two layers
    (the one in use and the one prefetched).
    """
    config, model, spec = plan.config, plan.model, plan.spec
    p, stage = config.parallel, config.parallel.zero_stage
    if stage == "optimizer":
        return 0
    dense, expert = spec.params_per_rank(model, plan.parallel, max(plan.rank_layers))
    per_rank = dense + expert
    embed = model.vocab_size * model.hidden_size // p.tp
    matrices = 2 if p.pp == 1 and not model.tie_embeddings else 1
    layer = max(0, per_rank - matrices * embed) // max(1, max(plan.rank_layers))
    bucket = min(per_rank, max(p.bucket_size, embed))
    grads = 3 * bucket * 4
    if stage == "gradients":
        return grads
    return grads + (matrices * embed + 2 * layer) * width
