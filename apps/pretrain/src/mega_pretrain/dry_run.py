"""``--dry-run``: the plan of the whole job before it starts.

The resolved config, sizes, memory per rank, FLOPs, the batch, the pipeline bubble the
schedule predicts, steps and total tokens, the data source (with a warning when a large
model is about to train on the small built-in corpus) and the rank layout.
"""

from __future__ import annotations

import json

import torch

from mega_pipeline import OverlappedForwardBackward
from mega_pretrain.auto_batch import resolve_micro_batch
from mega_pretrain.build import gpt_config
from mega_pretrain.config import TrainerConfig, config_to_dict
from mega_pretrain.data import default_corpus
from mega_pretrain.estimate import estimate
from mega_pretrain.plan import Plan
from mega_pretrain.runtime import precision_phrase, with_precision
from mega_pretrain.validate import check_config
from mega_pretrain.wandb_sink import check_wandb

__all__ = ["LARGE_MODEL_PARAMS", "builtin_corpus_tokens", "data_lines", "dry_run"]

#: Parameters above which the built-in corpus is too small to train on (it gets a warning).
LARGE_MODEL_PARAMS = 100_000_000


#: ZeRO stage of each ``parallel.sharding``.
_ZERO = {"optimizer": 1, "gradients": 2, "parameters": 3}


def _gib(n: float) -> str:
    return f"{n / 2**30:8.2f} GiB"


def builtin_corpus_tokens() -> int:
    """Tokens of the built-in corpus, counted from its files without tokenizing them
    (byte-level: one token a byte, and one end-of-document token a file)."""
    files = default_corpus()
    return sum(f.stat().st_size for f in files) + len(files)


def data_lines(config: TrainerConfig, total_params: int) -> list[str]:
    """Where the tokens come from, and a warning when the model would overfit the
    built-in corpus."""
    d = config.data
    if d.paths:
        weights = list(d.weights) or [1.0] * len(d.paths)
        parts = ", ".join(f"{p} (weight {w:g})" for p, w in zip(d.paths, weights, strict=False))
        return [f"data: {parts}; tokenizer {d.tokenizer}"]
    tokens = builtin_corpus_tokens()
    lines = [
        f"data: the built-in corpus (the standard library's sources), {tokens:,} tokens, byte-level"
    ]
    if total_params > LARGE_MODEL_PARAMS:
        lines.append(
            f"warning: the built-in corpus is {tokens:,} tokens; a model of "
            f"{total_params:,} parameters will overfit it; point data.paths at a real dataset"
        )
    return lines


def _dualpipev_lines(config: TrainerConfig, plan: Plan) -> list[str]:
    """Whether DualPipeV's F&B pairs overlap; nothing under the other schedules."""
    if config.parallel.resolved_pp_schedule() != "dualpipev":
        return []
    if not config.parallel.dualpipev_overlap:
        how = "run apart, each pair's forward then its backward (parallel.dualpipev_overlap false)"
    elif issubclass(plan.spec.model_class, OverlappedForwardBackward):
        how = (
            "overlapped, one micro-batch's forward interleaved layer by layer with the other's "
            "backward, MoE all-to-alls in flight behind compute (parallel.dualpipev_overlap true)"
        )
    else:
        how = (
            f"run apart, each pair's forward then its backward ({plan.spec.name} chunks offer "
            "no overlapped forward-backward)"
        )
    return [f"dualpipev pairs: {how}"]


def _logging_line(config: TrainerConfig) -> str:
    r = config.run
    sinks = ["metrics.jsonl", *(["tensorboard"] if r.tensorboard else [])]
    if r.wandb:
        entity = f"{r.wandb_entity}/" if r.wandb_entity else ""
        sinks.append(f"wandb ({entity}{r.wandb_project}, mode {r.wandb_mode})")
    ckpt = config.checkpoint
    how = "in the background" if ckpt.async_save else "blocking"
    every = f"every {ckpt.save_interval} steps" if ckpt.save_interval else "at the end"
    return (
        f"logging: {', '.join(sinks)}; checkpoints {every} and on SIGTERM, {how} "
        f"(checkpoint.async_save {str(ckpt.async_save).lower()}), the last {ckpt.keep_last} kept"
    )


def dry_run(config: TrainerConfig, world_size: int) -> str:
    """Everything a user checks before launching, computed without any process or tensor."""
    model = gpt_config(config)
    cuda = torch.cuda.is_available() and config.run.device != "cpu"
    asked = config.train.precision
    config = with_precision(config, "cuda" if cuda else "cpu")
    how = f" (train.precision auto on {'cuda' if cuda else 'cpu'})" if asked == "auto" else ""
    memory = torch.cuda.get_device_properties(0).total_memory if cuda else None
    config, auto_line = resolve_micro_batch(config, model, world_size, memory)
    plan = check_config(config, model, world_size)
    check_wandb(config)
    est = estimate(plan)
    t = config.train
    lines = [
        *([auto_line] if auto_line is not None else []),
        "resolved config:",
        json.dumps(config_to_dict(config), indent=2),
        f"model: {config.model.size} {model}",
        f"precision: {precision_phrase(config, 'cuda' if cuda else 'cpu')}{how}",
        f"collective timeout: {config.run.timeout_minutes:g} min (run.timeout_minutes)",
        f"schedule: {t.warmup} warm-up steps to lr {t.lr:g}, then {t.decay} decay to "
        f"{t.min_lr:g} by step {t.steps}",
        *plan.describe(),
        *_dualpipev_lines(config, plan),
        f"parameters: {est.total_params / 1e6:,.1f} M total, ~{est.params_per_rank / 1e6:,.1f} M per rank",
        f"FLOPs per token (fwd+bwd): {est.flops_per_token / 1e9:.3f} GFLOP",
        "memory per rank (estimate, busiest stage):",
        f"  sharding    {config.parallel.zero_stage} "
        f"(ZeRO-{_ZERO[config.parallel.zero_stage]}, parallel.sharding)",
        f"  weights     {_gib(est.weights)}",
        f"  gradients   {_gib(est.grads)}",
        f"  optimizer   {_gib(est.optimizer)}",
        f"  activations {_gib(est.activations)}",
        *(
            [f"  in flight   {_gib(est.in_flight)} (ZeRO-2/3: buckets reduced, layers gathered)"]
            if est.in_flight
            else []
        ),
        *(
            [
                f"  fp8 cache   {_gib(est.fp8_cache)} (train.fp8_weight_cache: fp8 weights, transposed)"
            ]
            if est.fp8_cache
            else []
        ),
        f"  total       {_gib(est.total)}",
        *(
            [f"  host        {_gib(est.host)} (parallel.optimizer_offload: masters, moments)"]
            if est.host
            else []
        ),
        *data_lines(config, est.total_params),
        _logging_line(config),
        "rank layout:",
        plan.layout.table() if world_size <= 64 else f"({world_size} ranks; table omitted)",
    ]
    return "\n".join(lines)
