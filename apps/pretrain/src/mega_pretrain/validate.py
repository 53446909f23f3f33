"""Every check that can be made before a process group exists: one sentence each."""

from __future__ import annotations

from pathlib import Path

import torch

from mega_models import GPTConfig
from mega_pretrain.config import TrainerConfig
from mega_pretrain.data import check_vocab
from mega_pretrain.data.packing import check_packing
from mega_pretrain.graphs import check_compile_mode
from mega_pretrain.plan import Plan, plan_for
from mega_pretrain.runtime import resolve_precision
from mega_pretrain.sharding import check_sharding
from mega_tp_layers import check_amax_history, check_amax_interval, check_amax_margin

__all__ = ["check_config", "check_expert_fp8_device"]


def _check_v_schedule(schedule: str, microbatches: int, pp: int) -> None:
    """ZBV/DualPipeV: the V puts the first and last stages on pp rank 0, as two chunks (a
    tied or MTP-shared embedding's two copies are summed there)."""
    if schedule not in ("zbv", "dualpipev"):
        return
    if schedule == "dualpipev" and microbatches < 2 * pp:
        raise ValueError(
            f"parallel.pp_schedule 'dualpipev' needs at least 2 * pp ({2 * pp}) micro-batches "
            f"per step, but there are {microbatches}; raise train.global_batch_size or lower "
            "micro_batch_size"
        )


def _check_fp8_weight_cache(config: TrainerConfig) -> None:
    """``train.fp8_weight_cache``: tensor-wise fp8, and none of the layouts it cannot serve."""
    p, t = config.parallel, config.train
    if not (t.fp8 and t.fp8_recipe == "tensor"):
        raise ValueError(
            "train.fp8_weight_cache keeps tensor-wise fp8 weights, which needs train.fp8 true "
            f"and train.fp8_recipe tensor (got fp8={str(t.fp8).lower()}, recipe "
            f"{t.fp8_recipe}); set those or train.fp8_weight_cache false"
        )
    if p.tp_comm_overlap:
        raise ValueError(
            "train.fp8_weight_cache is not supported with parallel.tp_comm_overlap true (its "
            "rings quantise the weight themselves); turn one of them off"
        )
    if p.zero_stage == "parameters":
        raise ValueError(
            f"train.fp8_weight_cache holds every layer's whole weight in fp8 for the run, which "
            f"parallel.sharding {p.sharding} (ZeRO-3) exists to avoid; turn one of them off"
        )
    if t.compile_mode == "reduce-overhead":
        raise ValueError(
            "train.fp8_weight_cache writes its buffers inside the layers' forward, which "
            "train.compile_mode reduce-overhead (CUDA graphs) has not been run with; use "
            "compile_mode default or train.fp8_weight_cache false"
        )


def _check_expert_fp8_layout(config: TrainerConfig, model: GPTConfig) -> None:
    """``model.moe_expert_fp8``: what the FP8 experts' weight cache cannot serve."""
    p = config.parallel
    if model.moe_expert_fp8 and p.zero_stage == "parameters":
        raise ValueError(
            f"model.moe_expert_fp8 keeps every local expert's weight in fp8 for the whole step, "
            f"which parallel.sharding {p.sharding} (ZeRO-3) exists to avoid; turn one of them off"
        )


def check_expert_fp8_device(
    config: TrainerConfig,
    model: GPTConfig,
    device_type: str,
    capability: tuple[int, int] | None = None,
) -> None:
    """``model.moe_expert_fp8``: what the FP8 experts need of the device (``capability``:
    the CUDA device's, read from it when not given). Elsewhere the same fp8 values are
    multiplied in fp32 (tests, CPU runs)."""
    t = config.train
    if not model.moe_expert_fp8 or device_type != "cuda":
        return  # the same fp8 values multiplied in fp32 (tests, CPU runs)
    if capability is None:
        capability = torch.cuda.get_device_capability()
    if capability < (9, 0):
        raise ValueError(
            f"model.moe_expert_fp8 runs torch._scaled_grouped_mm, which needs a GPU of compute "
            f"capability 9.0 or newer (this one: {capability[0]}.{capability[1]}); turn it off"
        )
    precision = resolve_precision(t.precision, device_type)
    if precision != "bf16":
        raise ValueError(
            f"model.moe_expert_fp8 on a GPU takes bf16 activations, but train.precision is "
            f"{t.precision} ({precision}); set --train.precision bf16 or turn it off"
        )


def _check_moment_dtype(config: TrainerConfig) -> None:
    """``train.optimizer_moment_dtype``: bf16 moments live in the flat kernel's device buffers."""
    p, t = config.parallel, config.train
    if t.optimizer_moment_dtype not in ("fp32", "bf16"):
        raise ValueError(
            f"train.optimizer_moment_dtype ({t.optimizer_moment_dtype!r}) must be 'fp32' or 'bf16'"
        )
    if t.optimizer_moment_dtype == "fp32":
        return
    if t.optimizer_kernel == "torch":
        raise ValueError(
            "train.optimizer_moment_dtype 'bf16' keeps the moments in the flat kernel's "
            "buffers, but train.optimizer_kernel is 'torch'; use optimizer_kernel 'flat' or "
            "'auto', or optimizer_moment_dtype 'fp32'"
        )
    if p.optimizer_offload:
        raise ValueError(
            "train.optimizer_moment_dtype 'bf16' keeps the moments on the device, but "
            "parallel.optimizer_offload true keeps fp32 state on the host; turn the offload "
            "off or use optimizer_moment_dtype 'fp32'"
        )


def check_config(config: TrainerConfig, model: GPTConfig, world_size: int) -> Plan:
    """Raise ValueError (one sentence naming the values) for any inconsistent setting;
    return the run's plan (dp, micro-batches, stage split, ...), checked."""
    p, t = config.parallel, config.train
    plan = plan_for(config, world_size, model)
    dp = plan.dp
    for name in ("steps", "seq_len", "micro_batch_size", "global_batch_size", "log_interval"):
        value = getattr(t, name)
        if value < 1:
            raise ValueError(f"train.{name} ({value}) must be at least 1")
    if t.loss_chunk_size < 0:
        raise ValueError(
            f"train.loss_chunk_size ({t.loss_chunk_size}) must be 0 (off) or a positive number "
            "of tokens per chunk, e.g. 4096"
        )
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ValueError(
            f"train.global_batch_size ({t.global_batch_size}) is not divisible by "
            f"micro_batch_size * dp ({t.micro_batch_size} * {dp}); choose a multiple of "
            f"{t.micro_batch_size * dp}"
        )
    microbatches = plan.microbatches
    schedule = p.resolved_pp_schedule()  # fits vpp and pp
    if schedule in ("zb-h1", "zbv", "dualpipev") and t.recompute == "full":
        raise ValueError(
            f"parallel.pp_schedule {schedule!r} defers the weight gradients of the forward's "
            "linears, but train.recompute 'full' reruns that forward in backward, where nothing "
            "defers; use train.recompute 'selective' or 'none', or pp_schedule '1f1b'"
        )
    _check_v_schedule(schedule, microbatches, p.pp)
    if not p.dualpipev_overlap and schedule != "dualpipev":
        raise ValueError(
            f"parallel.dualpipev_overlap false only applies to pp_schedule 'dualpipev', but the "
            f"schedule is {schedule!r}; drop the setting or set --parallel.pp_schedule dualpipev"
        )
    if schedule == "interleaved" and microbatches % p.pp:
        raise ValueError(
            f"the interleaved schedule needs micro-batches per step ({microbatches}) to be a "
            f"multiple of pp ({p.pp}); raise train.global_batch_size or lower micro_batch_size"
        )
    check_packing(config, model, plan.spec.name)  # data.reset_*, eod_mask_loss; seq_len too
    if t.seq_len > model.max_seq_len:
        raise ValueError(
            f"train.seq_len ({t.seq_len}) exceeds the model's max_seq_len ({model.max_seq_len}); "
            "shorten it or set model.max_seq_len"
        )
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        raise ValueError(
            f"train.seq_len ({t.seq_len}) is not divisible by 2*cp ({2 * p.cp}); choose a multiple of {2 * p.cp}"
        )
    if p.sequence_parallel:
        if p.tp == 1:
            raise ValueError("parallel.sequence_parallel needs tp > 1; set --tp or turn it off")
        if plan.local_seq_len % p.tp:
            raise ValueError(
                f"with sequence parallelism the sequence per cp rank ({plan.local_seq_len}) must be "
                f"divisible by tp ({p.tp}); change train.seq_len"
            )
    plan.spec.check_layout(model, plan.layout_request)  # the family's own checks
    if not isinstance(t.fp8_weight_cache, bool):
        raise ValueError(f"train.fp8_weight_cache ({t.fp8_weight_cache!r}) must be true or false")
    if t.fp8_weight_cache:
        _check_fp8_weight_cache(config)
    if t.optimizer_kernel not in ("auto", "torch", "flat"):
        raise ValueError(
            f"train.optimizer_kernel ({t.optimizer_kernel!r}) must be 'auto', 'torch' or 'flat'"
        )
    if t.optimizer_kernel == "flat" and p.optimizer_offload:
        raise ValueError(
            "train.optimizer_kernel 'flat' updates the shards on the device, but "
            "parallel.optimizer_offload true updates them on the host; use "
            "optimizer_kernel 'torch' or turn the offload off"
        )
    _check_moment_dtype(config)
    _check_expert_fp8_layout(config, model)
    check_compile_mode(config, model)  # train.compile_mode (CUDA graphs)
    precision = resolve_precision(t.precision)
    if t.fp8_recipe != "tensor" and not t.fp8:
        raise ValueError(
            f"train.fp8_recipe ({t.fp8_recipe}) applies only with train.fp8 true; set "
            "train.fp8 true or leave train.fp8_recipe at tensor"
        )
    history = check_amax_history("train.fp8_amax_history", t.fp8_amax_history)
    if history and not (t.fp8 and t.fp8_recipe == "tensor"):
        raise ValueError(
            f"train.fp8_amax_history ({history}) is delayed scaling, which needs train.fp8 true "
            f"and train.fp8_recipe tensor (got fp8={str(t.fp8).lower()}, recipe "
            f"{t.fp8_recipe}); set those or train.fp8_amax_history 0"
        )
    margin = check_amax_margin("train.fp8_amax_margin", t.fp8_amax_margin)
    if margin and not history:
        raise ValueError(
            f"train.fp8_amax_margin ({margin}) gives delayed scaling headroom, but "
            "train.fp8_amax_history is 0 (current scaling never saturates); set "
            "train.fp8_amax_history n or train.fp8_amax_margin 0"
        )
    interval = check_amax_interval("train.fp8_amax_interval", t.fp8_amax_interval)
    if interval > 1 and not history:
        raise ValueError(
            f"train.fp8_amax_interval ({interval}) spaces delayed scaling's recording, but "
            "train.fp8_amax_history is 0; set train.fp8_amax_history n or "
            "train.fp8_amax_interval 1"
        )
    if history and p.tp_comm_overlap:
        raise ValueError(
            f"train.fp8_amax_history ({history}) is not supported with "
            "parallel.tp_comm_overlap true (its rings scale by the current amax); turn the "
            "overlap off or set train.fp8_amax_history 0"
        )
    if t.fp8 and precision != "bf16":
        raise ValueError(
            f"train.fp8 needs train.precision bf16, not {t.precision}"
            f"{f' (resolved to {precision})' if t.precision != precision else ''}; set "
            "train.precision bf16 or turn fp8 off"
        )
    if p.tp_comm_overlap and (not p.sequence_parallel or p.tp == 1):
        raise ValueError(
            f"parallel.tp_comm_overlap needs parallel.sequence_parallel true and tp > 1 (got "
            f"sequence_parallel={str(p.sequence_parallel).lower()}, tp={p.tp}); turn it off "
            "or enable sequence parallelism"
        )
    if p.overlap_param_gather and p.distributed_optimizer and model.tie_embeddings and p.pp > 1:
        raise ValueError(
            "parallel.overlap_param_gather with model.tie_embeddings at pp > 1 is not supported: "
            "the last stage reads the tied embedding outside the module whose forward waits for "
            "its gather; turn overlap_param_gather off or untie the embeddings"
        )
    if t.warmup < 0 or t.lr <= 0 or t.min_lr < 0:
        raise ValueError(
            f"train.lr ({t.lr}), min_lr ({t.min_lr}) and warmup_steps ({t.warmup}) must be positive"
        )
    if t.warmup > t.steps:
        raise ValueError(
            f"train.warmup_steps ({t.warmup}) exceeds train.steps ({t.steps}), so the "
            "learning rate would never reach train.lr; lower warmup_steps or raise steps"
        )
    if not config.run.timeout_minutes > 0:
        raise ValueError(
            f"run.timeout_minutes ({config.run.timeout_minutes}) must be positive: the minutes "
            "a rank waits for its peers in a collective before failing, e.g. 10"
        )
    _check_optimizer(config)
    check_sharding(config, model)  # parallel.sharding (ZeRO-2/3) against the rest
    if t.eval_interval > 0:
        if t.eval_steps < 1:
            raise ValueError(
                f"train.eval_steps ({t.eval_steps}) must be at least 1 while train.eval_interval "
                f"({t.eval_interval}) > 0; raise it, or set eval_interval 0 to turn evaluation off"
            )
        if p.vpp and t.eval_steps % p.pp:
            raise ValueError(
                f"the interleaved schedule evaluates a multiple of pp ({p.pp}) micro-batches, "
                f"but train.eval_steps is {t.eval_steps}; choose a multiple of {p.pp}"
            )
    if config.checkpoint.keep_last < 1:
        raise ValueError(
            f"checkpoint.keep_last ({config.checkpoint.keep_last}) must be at least 1 (the "
            "checkpoints kept on disk); choose 1 or more"
        )
    if not 0.0 <= config.data.valid_fraction < 1.0:
        raise ValueError(f"data.valid_fraction ({config.data.valid_fraction}) must be in [0, 1)")
    for prefix in config.data.paths:
        missing = [
            f"{prefix}{ext}" for ext in (".idx", ".bin") if not Path(f"{prefix}{ext}").is_file()
        ]
        if missing:
            raise ValueError(
                f"data.paths entry {prefix!r} has no {' or '.join(missing)}; give the prefix "
                "`mega-pretrain preprocess --output` wrote, or a Megatron .bin/.idx prefix (without .idx/.bin)"
            )
    for prefix in config.data.paths:
        check_vocab(prefix, model.vocab_size)
    if config.data.weights and len(config.data.weights) != len(config.data.paths):
        raise ValueError(
            f"data.weights has {len(config.data.weights)} entries but data.paths has "
            f"{len(config.data.paths)}; give one weight per path"
        )
    return plan


def _check_optimizer(config: TrainerConfig) -> None:
    """AdamW's and the schedule's numbers in their ranges."""
    t = config.train
    if t.min_lr > t.lr:
        raise ValueError(
            f"train.min_lr ({t.min_lr}) is above train.lr ({t.lr}); the schedule decays from "
            "lr to min_lr, so choose min_lr <= lr"
        )
    for name in ("beta1", "beta2"):
        value = getattr(t, name)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"train.{name} ({value}) must be in [0, 1), e.g. 0.9 or 0.95")
    if t.eps <= 0:
        raise ValueError(f"train.eps ({t.eps}) must be positive, e.g. 1e-8")
    if not 0.0 <= t.wsd_decay_fraction <= 1.0:
        raise ValueError(
            f"train.wsd_decay_fraction ({t.wsd_decay_fraction}) must be in [0, 1], the share "
            "of the steps spent decaying"
        )
    if t.seed < 0:
        raise ValueError(f"train.seed ({t.seed}) must be a non-negative integer")
