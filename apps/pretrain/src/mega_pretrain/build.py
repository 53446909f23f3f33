"""Build the model chunks, the data-parallel wrapper and the optimizer for one rank."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from mega_models import GPTConfig, lm_head, stage_spec
from mega_models.doc_mask import DocumentPacking
from mega_models.families import ModelChunk
from mega_models.overlap import OverlappedStage
from mega_models.spec import spec_for
from mega_moe import expert_shard
from mega_parallel_grid import ParallelConfig, ProcessGroups
from mega_pretrain.config import TrainConfig, TrainerConfig
from mega_pretrain.data.packing import packing_for
from mega_pretrain.graphs import compile_kwargs, uses_cuda_graphs
from mega_pretrain.plan import resolve_model_config
from mega_pretrain.runtime import resolve_precision
from mega_tp_layers import (
    SEQUENCE_PARALLEL_ATTR,
    Fp8Recipe,
    RNGStatesTracker,
    set_fp8_grad_unit,
    tp_rng_tracker,
)
from mega_zero_optim import DistributedDataParallel, DistributedOptimizer, DynamicLossScaler

__all__ = [
    "Built",
    "ModelChunk",
    "build",
    "flat_optimizer_kernel",
    "gpt_config",
    "parallel_config",
    "param_dtype",
]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Built:
    """What one rank trains: its model chunks (one per virtual stage), DDP, optimizer.

    ``ddp`` reduces the dense parameters' gradients over dp x cp; an MoE model also has
    ``expert_ddp``, which reduces the expert weights' over the expert data-parallel group.
    ``packing``: how packed documents are read (``data.reset_*``, ``data.eod_mask_loss``).
    """

    chunks: list[ModelChunk]
    ddp: DistributedDataParallel
    optimizer: DistributedOptimizer
    rng: RNGStatesTracker
    expert_ddp: DistributedDataParallel | None = None
    packing: DocumentPacking | None = None
    pp_schedule: str = "1f1b"
    """``parallel.pp_schedule`` resolved: ``1f1b``, ``interleaved``, ``zb-h1``, or the V
    schedules ``zbv`` and ``dualpipev`` (vpp 2: chunk 1 of pp rank ``r`` is virtual stage
    ``2 pp - 1 - r``, so rank 0 holds the first and the last stage)."""
    whole_ddp: DistributedDataParallel | None = None
    """Under ``parallel.sharding`` gradients/parameters: the parameters whose gradients are
    summed over tp or pp after the dp reduction (sequence-parallel norms, a tied embedding
    split over pp), kept at ZeRO-1 so that those gradients stay whole."""

    @property
    def ddps(self) -> list[DistributedDataParallel]:
        """Every data-parallel wrapper: the dense one, the experts' (MoE models), then the
        whole-gradient one (ZeRO-2/3 with such parameters)."""
        return [d for d in (self.ddp, self.expert_ddp, self.whole_ddp) if d is not None]

    @contextmanager
    def forward_context(self) -> Iterator[None]:
        """Around each chunk's forward: ZeRO-3's root unit gathered and its saved
        parameters tracked (nothing for the other stages)."""
        first, *others = self.ddps
        with first.forward_context(*others):
            yield

    @contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Inside, every parameter holds its full values (ZeRO-3 gathers them; read only)."""
        self.optimizer.wait()  # parallel.optimizer_offload: the last step's host update
        with ExitStack() as stack:
            for ddp in self.ddps:
                stack.enter_context(ddp.gathered_parameters())
            yield


def parallel_config(config: TrainerConfig) -> ParallelConfig:
    """The config's parallel degrees as a ParallelConfig (``config.parallel.parallel_config()``)."""
    return config.parallel.parallel_config()


def gpt_config(config: TrainerConfig) -> GPTConfig:
    """The registered size with the config's overrides applied, of whichever family
    (:func:`mega_models.spec.resolve_model`: a GPT size given ``model.pattern`` becomes the
    hybrid of that size's dimensions)."""
    return resolve_model_config(config)


def flat_optimizer_kernel(
    kernel: str, device: torch.device, optimizer_offload: bool, moment_dtype: str = "fp32"
) -> bool:
    """Whether ``train.optimizer_kernel`` steps through the flat kernel: ``flat``, or
    ``auto`` on CUDA without the host offload (where it measured 1.021x, see the config)
    or with bf16 moments on any device (only the flat step keeps them)."""
    if kernel == "auto":
        return moment_dtype == "bf16" or (device.type == "cuda" and not optimizer_offload)
    return kernel == "flat"


def param_dtype(config: TrainerConfig, device: torch.device | None = None) -> torch.dtype:
    """The parameters' dtype on ``device`` (``auto`` precision resolved for it)."""
    return _DTYPES[resolve_precision(config.train.precision, device.type if device else None)]


def build(config: TrainerConfig, groups: ProcessGroups, device: torch.device) -> Built:
    """Model chunks of this rank's stages, wrapped for data parallelism, and the optimizer."""
    model = gpt_config(config)
    p, t = config.parallel, config.train
    pp, vpp = groups.size("pp"), p.vpp
    rng = tp_rng_tracker(t.seed, groups.tp, device)
    kwargs: dict[str, Any] = {
        "sequence_parallel": p.sequence_parallel, "recompute": t.recompute, "seed": t.seed,
        "rng": rng, "device": device, "dtype": param_dtype(config, device),
    }  # fmt: skip
    spec = spec_for(model)
    chunks: list[ModelChunk] = []
    for index in range(vpp or 1):
        split = p.pp_layers or None  # None: an even split
        rank = groups.rank("pp")
        if index == 1 and p.pp_schedule in ("zbv", "dualpipev"):  # the V: stage 2 pp - 1 - rank
            rank = pp - 1 - rank
        stage = stage_spec(model.num_layers, pp, rank, vpp, index, split)
        chunk = spec.build(
            model, groups, stage, cp_method=p.cp_method,
            fp8=Fp8Recipe(
                scaling=t.fp8_recipe, amax_history=t.fp8_amax_history,
                amax_margin=t.fp8_amax_margin, amax_interval=t.fp8_amax_interval,
                cache_weights=t.fp8_weight_cache,
            )
            if t.fp8
            else False,
            tp_comm_overlap=p.tp_comm_overlap, **kwargs,
        )  # fmt: skip
        if isinstance(chunk, OverlappedStage):  # DualPipeV's pairs overlapped, or apart
            chunk.overlap_pairs = p.dualpipev_overlap
        chunks.append(cast(ModelChunk, chunk))
    # delayed fp8 scaling: each rank's output gradients are dp x cp times one process's
    # (StepRunner's loss normalisation); the histories keep one process's amaxes
    set_fp8_grad_unit(chunks, groups.size("dp") * groups.size("cp"))
    if t.loss_chunk_size:  # the fused output layer + loss: no [tokens, vocab] logits
        n = t.loss_chunk_size
        for chunk in chunks:
            chunk.head_fn = lambda *a, **k: lm_head(*a, loss_chunk_size=n, **k)
    if t.compile:
        for chunk in chunks:
            for layer in chunk.layers.values():
                layer.compile(**compile_kwargs(config))
            for depth in getattr(chunk, "mtp", None) or []:  # an MTP depth's layer too
                depth.layer.compile(**compile_kwargs(config))
            if chunk.stage.last and groups.size("tp") == 1:
                # norm, output projection and loss in one graph: the fp32 logits are never
                # written out (at tp > 1 the vocabulary-parallel loss runs eagerly)
                chunk.head_fn = torch.compile(chunk.head_fn)
    # A tied embedding (or one MTP reuses) split over pp has one copy on each end stage, at
    # different places in the two stages' gradient buffers; after a reduce-scatter each dp
    # rank would hold different parts of them, so such models all-reduce gradients (state
    # stays sharded).
    tied_across_stages = (model.tie_embeddings or model.mtp_num_layers > 0) and pp > 1
    wrapped = nn.ModuleList(chunks)
    ddp, expert_ddp, whole_ddp = _wrap(
        wrapped, chunks, config, groups, model.is_moe, tied_across_stages
    )
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in ddp.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.dim() < 2 or name.endswith("bias") else decay).append(param)
    fused = device.type == "cuda" or p.optimizer_offload  # offload: the CPU's fused kernel
    adam = torch.optim.AdamW(
        [{"params": decay, **_group_settings(t, 0)}, {"params": no_decay, **_group_settings(t, 1)}],
        lr=t.lr, fused=fused,
    )  # fmt: skip
    # expert weights differ over ep x etp: every rank counts its own shards once in the norm
    built_ddps = [d for d in (ddp, expert_ddp, whole_ddp) if d is not None]
    optimizer = DistributedOptimizer(
        adam, built_ddps,
        max_grad_norm=t.clip_grad if t.clip_grad > 0 else None,
        grad_norm_group=groups.world,
        loss_scaler=DynamicLossScaler() if t.precision == "fp16" else None,
        overlap_param_gather=p.overlap_param_gather and p.distributed_optimizer,
        optimizer_offload=p.optimizer_offload,
        # the host update overlaps the next forward, unless a stage reads a weight outside
        # the module whose pre-hook waits for it (a tied weight split over pp)
        overlap_host_update=p.optimizer_offload and not tied_across_stages,
        flat_fused=flat_optimizer_kernel(
            t.optimizer_kernel, device, p.optimizer_offload, t.optimizer_moment_dtype
        ),
        moment_dtype=torch.bfloat16 if t.optimizer_moment_dtype == "bf16" else torch.float32,
    )  # fmt: skip
    return Built(
        chunks, ddp, optimizer, rng, expert_ddp, packing_for(config),
        config.parallel.resolved_pp_schedule(), whole_ddp,
    )  # fmt: skip


def _wrap(
    wrapped: nn.ModuleList,
    chunks: list[ModelChunk],
    config: TrainerConfig,
    groups: ProcessGroups,
    is_moe: bool,
    tied_across_stages: bool,
) -> tuple[DistributedDataParallel, DistributedDataParallel | None, DistributedDataParallel | None]:
    """The dense, the expert (MoE) and the whole-gradient data-parallel wrappers.

    Under ZeRO-2/3 (``parallel.sharding``) the parameters whose gradients
    :func:`~mega_models.finalize_model_grads` still sums after the dp reduction (replicated
    over tp under sequence parallelism or QK-norm; a tied embedding over the pp ends) would
    have had their full gradients freed: they get a wrapper of their own at ZeRO-1, whose
    ``main_grad`` stays whole. ZeRO-3 gathers each transformer layer (and an MTP depth's
    layer) as one unit; the embedding, the final norm and the head stay in the root unit,
    gathered for the whole step (a tied head reads the embedding outside its module).
    """
    p, stage = config.parallel, config.parallel.zero_stage
    sharded = stage != "optimizer"
    tp = groups.size("tp")

    def whole(name: str, param: nn.Parameter) -> bool:
        if not sharded:
            return False
        if tp > 1 and getattr(param, SEQUENCE_PARALLEL_ATTR, False):
            return True
        return tied_across_stages and name.split(".", 1)[-1] == "embedding.word.weight"

    units: list[nn.Module] | None = None
    if stage == "parameters":
        units = [layer for chunk in chunks for layer in chunk.layers.values()]
        units += [d.layer for chunk in chunks for d in getattr(chunk, "mtp", None) or []]
    common: dict[str, Any] = {
        "bucket_size": p.bucket_size, "overlap_grad_reduce": p.overlap_grad_reduce,
        # not under CUDA graphs: the fused op's host key would split each layer's graph
        "wgrad_into_main_grad": p.wgrad_into_main_grad and not uses_cuda_graphs(config),
    }  # fmt: skip
    # HSDP (parallel.dp_shard): the dense wrappers shard within dp_shard x cp and all-reduce
    # across the replicas; the experts shard within edp_shard (the part of edp inside one
    # replica) and all-reduce across edp_replicate
    hsdp = p.dp_shard is not None and groups.size("dp_replicate") > 1
    expert_hsdp = p.dp_shard is not None and groups.size("edp_replicate") > 1
    dense_group = groups.dp_shard_cp if hsdp else groups.dp_cp
    replicas = groups.dp_replicate if hsdp else None
    zero: dict[str, Any] = {"sharding": stage, "gather_units": units}
    if not sharded:
        zero["use_distributed_optimizer"] = p.distributed_optimizer and not tied_across_stages
    has_whole = any(whole(n, q) and not _expert(n, q) for n, q in wrapped.named_parameters())

    def dense(name: str, param: nn.Parameter) -> bool:
        return _dense(name, param) and not whole(name, param)

    ddp = DistributedDataParallel(
        wrapped, dp_group=dense_group, param_filter=dense if is_moe or has_whole else None,
        replicate_group=replicas, **common, **zero,
    )  # fmt: skip
    expert_ddp = None
    if is_moe:
        # Expert weights are replicated only over edp, but each one's gradient already sums
        # the tokens its ep x etp ranks routed to it: summed over edp and scaled by 1/(dp*cp)
        # it is the same mean over the global batch as the dense gradients' average.
        expert_ddp = DistributedDataParallel(
            wrapped, dp_group=groups.edp_shard if expert_hsdp else groups.edp,
            replicate_group=groups.edp_replicate if expert_hsdp else None,
            param_filter=_expert, grad_reduce="sum", grad_scale=1.0 / groups.size("dp_cp"),
            **common, **zero,
        )  # fmt: skip
    whole_ddp = None
    if has_whole:
        whole_ddp = DistributedDataParallel(
            wrapped, dp_group=dense_group, sharding="optimizer",
            param_filter=lambda n, q: _dense(n, q) and whole(n, q),
            use_distributed_optimizer=p.distributed_optimizer and not tied_across_stages,
            replicate_group=replicas, **common,
        )  # fmt: skip
    return ddp, expert_ddp, whole_ddp


def _group_settings(train: TrainConfig, index: int) -> dict[str, Any]:
    """AdamW's settings of parameter group ``index`` (0: decayed weights, 1: norms, biases)."""
    return {"betas": (train.beta1, train.beta2), "eps": train.eps,
            "weight_decay": train.weight_decay if index == 0 else 0.0}  # fmt: skip


def apply_optimizer_settings(optimizer: DistributedOptimizer, train: TrainConfig) -> list[str]:
    """Set AdamW's betas, eps and weight decay from ``train`` (after a checkpoint brought its
    own); return one "name old -> new" note per setting that changed."""
    notes: list[str] = []
    groups = optimizer.optimizer.param_groups  # [decay, no decay], as built above
    for index, group in enumerate(groups):
        for key, value in _group_settings(train, index).items():
            old = tuple(group[key]) if key == "betas" else group[key]
            if old != value and index == 0:
                notes.append(f"{key} {old} -> {value}")
            group[key] = value
    return notes


def _expert(_: str, param: nn.Parameter) -> bool:
    return expert_shard(param) is not None


def _dense(name: str, param: nn.Parameter) -> bool:
    return not _expert(name, param)
