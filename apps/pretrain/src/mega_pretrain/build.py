"""Build the model chunks, the data-parallel wrapper and the optimizer for one rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mega_models import GPTConfig, GPTModel, model_config, stage_spec
from mega_parallel_grid import ParallelConfig, ProcessGroups
from mega_pretrain.config import TrainerConfig
from mega_tp_layers import RNGStatesTracker, tp_rng_tracker
from mega_zero_optim import DistributedDataParallel, DistributedOptimizer, DynamicLossScaler

__all__ = ["Built", "build", "gpt_config", "parallel_config", "param_dtype"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Built:
    """What one rank trains: its model chunks (one per virtual stage), DDP, optimizer."""

    chunks: list[GPTModel]
    ddp: DistributedDataParallel
    optimizer: DistributedOptimizer
    rng: RNGStatesTracker


def parallel_config(config: TrainerConfig) -> ParallelConfig:
    p = config.parallel
    return ParallelConfig(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, vpp=p.vpp)


def gpt_config(config: TrainerConfig) -> GPTConfig:
    """The registered size with the config's overrides applied."""
    return model_config(config.model.size).replace(**config.model.overrides)


def param_dtype(config: TrainerConfig) -> torch.dtype:
    return _DTYPES[config.train.precision]


def build(config: TrainerConfig, groups: ProcessGroups, device: torch.device) -> Built:
    """Model chunks of this rank's stages, wrapped for data parallelism, and the optimizer."""
    model = gpt_config(config)
    p, t = config.parallel, config.train
    pp, vpp = groups.size("pp"), p.vpp
    rng = tp_rng_tracker(t.seed, groups.tp, device)
    chunks = [
        GPTModel(
            model, groups,
            stage=stage_spec(model.num_layers, pp, groups.rank("pp"), vpp, chunk),
            sequence_parallel=p.sequence_parallel, cp_method=p.cp_method,
            recompute=t.recompute, seed=t.seed, rng=rng, device=device, dtype=param_dtype(config),
        )
        for chunk in range(vpp or 1)
    ]  # fmt: skip
    if t.compile:
        for chunk in chunks:
            for layer in chunk.layers.values():
                layer.compile()
    # A tied embedding split over pp has one copy on each end stage, at different places in
    # the two stages' gradient buffers; after a reduce-scatter each dp rank would hold
    # different parts of them, so such models all-reduce gradients (state stays sharded).
    tied_across_stages = model.tie_embeddings and pp > 1
    ddp = DistributedDataParallel(
        nn.ModuleList(chunks), dp_group=groups.dp_cp, bucket_size=p.bucket_size,
        overlap_grad_reduce=p.overlap_grad_reduce,
        use_distributed_optimizer=p.distributed_optimizer and not tied_across_stages,
    )  # fmt: skip
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in ddp.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.dim() < 2 or name.endswith("bias") else decay).append(param)
    fused = device.type == "cuda"
    adam = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=fused,
    )  # fmt: skip
    optimizer = DistributedOptimizer(
        adam, ddp, max_grad_norm=t.clip_grad if t.clip_grad > 0 else None,
        grad_norm_group=groups.world,
        loss_scaler=DynamicLossScaler() if t.precision == "fp16" else None,
        overlap_param_gather=p.overlap_param_gather and p.distributed_optimizer,
    )  # fmt: skip
    return Built(chunks, ddp, optimizer, rng)
