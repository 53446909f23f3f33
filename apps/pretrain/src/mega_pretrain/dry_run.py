"""``--dry-run``: the resolved config, sizes, memory per rank, FLOPs and the rank layout."""

from __future__ import annotations

import json

import torch

from mega_pretrain.auto_batch import resolve_micro_batch
from mega_pretrain.build import gpt_config
from mega_pretrain.config import TrainerConfig, config_to_dict
from mega_pretrain.estimate import estimate
from mega_pretrain.runtime import precision_phrase, with_precision
from mega_pretrain.validate import check_config

__all__ = ["dry_run"]


def _gib(n: float) -> str:
    return f"{n / 2**30:8.2f} GiB"


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
        f"parameters: {est.total_params / 1e6:,.1f} M total, ~{est.params_per_rank / 1e6:,.1f} M per rank",
        f"FLOPs per token (fwd+bwd): {est.flops_per_token / 1e9:.3f} GFLOP",
        "memory per rank (estimate, busiest stage):",
        f"  weights     {_gib(est.weights)}",
        f"  gradients   {_gib(est.grads)}",
        f"  optimizer   {_gib(est.optimizer)}",
        f"  activations {_gib(est.activations)}",
        f"  total       {_gib(est.total)}",
        "rank layout:",
        plan.layout.table() if world_size <= 64 else f"({world_size} ranks; table omitted)",
    ]
    return "\n".join(lines)
