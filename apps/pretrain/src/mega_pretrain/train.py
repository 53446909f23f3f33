"""The training loop: data, model, schedule, logging, evaluation, checkpoints, signals."""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console

from mega_models import GPTConfig
from mega_parallel_grid import init_process_groups
from mega_pretrain.auto_batch import resolve_micro_batch
from mega_pretrain.build import (
    apply_optimizer_settings,
    build,
    gpt_config,
    param_dtype,
)
from mega_pretrain.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
)
from mega_pretrain.ckpt.meta import read_meta
from mega_pretrain.ckpt.saver import CheckpointSaver
from mega_pretrain.config import TrainerConfig, config_to_dict
from mega_pretrain.data import (
    BlendedDataset,
    DataError,
    DistributedBatchSampler,
    GPTDataset,
    IndexedTokenDataset,
    check_vocab,
    ensure_default_dataset,
    split_train_valid,
)
from mega_pretrain.errors import TrainingError
from mega_pretrain.metrics import MetricsLogger, peak_tflops
from mega_pretrain.moe_logging import moe_log_values
from mega_pretrain.mtp_logging import mtp_log_values
from mega_pretrain.phase_timer import PhaseTimer, breakdown_text
from mega_pretrain.progress import LiveProgress
from mega_pretrain.runtime import (
    collective_timeout,
    configure_attention_kernel,
    configure_tf32,
    pick_device,
    precision_phrase,
    set_intra_op_threads,
    start_distributed,
    with_precision,
    world_size_from_env,
)
from mega_pretrain.schedule import lr_at
from mega_pretrain.signals import RUN_END_FILE, StopRequest, write_run_end
from mega_pretrain.step import Microbatch, StepRunner
from mega_pretrain.validate import check_config, check_expert_fp8_device
from mega_pretrain.wandb_sink import check_wandb

__all__ = ["RunSummary", "TrainingError", "train"]


@dataclass
class RunSummary:
    """What a finished (or stopped) run reports."""

    run_dir: Path
    first_step: int
    last_step: int
    losses: list[float]
    tokens_per_s: float
    stopped_by: str | None
    checkpoint: Path | None


def _datasets(config: TrainerConfig, model: GPTConfig, samples: int) -> tuple[Any, Any]:
    t, d = config.train, config.data
    prefixes = list(d.paths) or [str(ensure_default_dataset())]
    weights = list(d.weights) or [1.0] * len(prefixes)
    if not d.paths:  # check_config checked data.paths already; the built-in corpus it cannot
        check_vocab(prefixes[0], model.vocab_size)
    trains, valids = [], []
    for prefix in prefixes:
        indexed = IndexedTokenDataset(prefix)
        train_docs, valid_docs = split_train_valid(indexed, d.valid_fraction, t.seed)
        if len(valid_docs) and valid_docs.num_tokens < t.seq_len + 1:
            raise DataError(
                f"the validation split of {prefix} (data.valid_fraction {d.valid_fraction}) "
                f"holds {valid_docs.num_tokens} tokens, fewer than seq_len + 1 "
                f"({t.seq_len + 1}) that one sample needs; raise data.valid_fraction, or set "
                "it to 0 to train without evaluation"
            )
        trains.append(GPTDataset(train_docs, t.seq_len, seed=t.seed, num_samples=samples))
        valids.append(
            GPTDataset(valid_docs, t.seq_len, seed=t.seed, shuffle=False)
            if len(valid_docs)
            else None
        )
    if len(trains) == 1:
        return trains[0], valids[0]
    train = BlendedDataset(list(zip(weights, trains, strict=True)), samples, t.seed)
    return train, next((v for v in valids if v is not None), None)


def _microbatches(dataset: Any, sampler_iter: Any, count: int) -> list[Microbatch]:
    out = []
    for _ in range(count):
        items = [dataset[i] for i in next(sampler_iter)]
        out.append(
            (torch.stack([x["tokens"] for x in items]), torch.stack([x["labels"] for x in items]))
        )
    return out


def train(config: TrainerConfig, *, console: Console | None = None) -> RunSummary:
    """Train as ``config`` says; resumes from the run folder's latest checkpoint by default."""
    model = gpt_config(config)
    world = world_size_from_env()
    device = pick_device(config.run.device)
    config = with_precision(config, device.type)  # `auto` made concrete for this device
    memory = (
        torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    )
    config, auto_line = resolve_micro_batch(config, model, world, memory)
    plan = check_config(config, model, world)  # before any process group exists
    cuda = device.type == "cuda"  # this rank's GPU, not whichever is current
    check_expert_fp8_device(config, model, device.type,
                            torch.cuda.get_device_capability(device) if cuda else None)  # fmt: skip
    check_wandb(config)
    timeout = collective_timeout(config.run.timeout_minutes)
    started = start_distributed(device, timeout)
    groups = init_process_groups(plan.parallel, timeout=timeout)
    configure_tf32(device, config.train.tf32)
    configure_attention_kernel(device, config.train.attention_kernel)
    threads = set_intra_op_threads()
    rank0 = dist.get_rank() == 0
    if console is None or not rank0:  # output goes to rank 0 only; one line per event
        console = Console(quiet=not rank0, soft_wrap=True)
    t, p = config.train, config.parallel
    run_dir = Path(config.run.out_dir) / config.run.name
    source = _resume_source(config, run_dir)
    done = _completed_step(config, source)  # before anything in the run folder is touched
    if done is not None:
        console.print(
            f"run `{config.run.name}` is already complete at step {done}; raise "
            "`--train.steps` to continue",
            markup=False,
        )
        end = run_dir / RUN_END_FILE
        if rank0 and source is not None and not end.exists():  # a job script reads it
            write_run_end(run_dir, stopped_by=None, step=done, steps=t.steps, checkpoint=source)
        if started:  # nothing ran on the groups; leave no NCCL resources behind
            dist.destroy_process_group()
        return RunSummary(run_dir, done, done, [], 0.0, None, source)
    if auto_line is not None:
        console.print(auto_line)
    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config_to_dict(config), indent=2))
    dp, dp_rank = plan.dp, groups.rank("dp")
    train_set, valid_set = _datasets(config, model, t.steps * t.global_batch_size)
    torch.manual_seed(t.seed)
    built = build(config, groups, device)
    runner = StepRunner(
        built, groups, seq_len=t.seq_len, micro_batch_size=t.micro_batch_size,
        hidden_size=model.hidden_size, dtype=param_dtype(config), device=device,
        sequence_parallel=p.sequence_parallel,
    )  # fmt: skip
    step, consumed = 0, 0
    if source is not None:
        state = load_checkpoint(source, built, groups)
        step, consumed = int(state["step"]), int(state["consumed_samples"])
        check_resume(state.get("config"), config, step, consumed, source)
        changed = apply_optimizer_settings(built.optimizer, t)  # this run's settings win
        console.print(f"resumed from {source} at step {step}")
        schedule_note = _schedule_change(state.get("config"), config)
        if schedule_note is not None:
            console.print(schedule_note)
        if changed:
            console.print(f"optimizer settings changed on resume: {', '.join(changed)}")
    metrics = MetricsLogger(run_dir, enabled=rank0, tensorboard=config.run.tensorboard,
                            config=config, layout={"world_size": world, "dp": dp})  # fmt: skip
    stop = StopRequest()
    sampler = iter(
        DistributedBatchSampler(len(train_set), consumed, t.micro_batch_size, dp_rank, dp)
    )
    peak = peak_tflops(device, config.run.peak_tflops)
    flops_token = plan.flops_per_token()
    tokens_per_step = plan.tokens_per_step
    first_step, losses, stopped_by, saved = step, [], None, None
    console.print(
        f"[bold]mega-pretrain[/bold] {config.model.size} on {world} rank(s) "
        f"(tp {p.tp}, pp {p.pp}, cp {p.cp}, dp {dp}), {device.type}, "
        f"{precision_phrase(config, device.type)}, {threads}, "
        f"{t.steps} steps of {tokens_per_step} tokens -> {run_dir}"
    )
    _warn_if_no_evaluation(valid_set, config, dp, console)
    window_start, window_steps, run_start = time.perf_counter(), 0, time.perf_counter()
    live = LiveProgress(console, t.steps, step)
    timer = PhaseTimer(device, sync=t.timing_sync)  # ms per step of each phase, per interval

    saver = CheckpointSaver(run_dir, built, groups, config.checkpoint, device=device,
                            timeout=timeout, say=lambda line: console.print(line, markup=False))  # fmt: skip

    def save(step: int, consumed: int) -> Path:
        with timer.phase("ckpt"):
            return saver.save(step, _state(config, step, consumed))

    try:
        live.__enter__()
        while step < t.steps:
            with timer.phase("ckpt"):
                saver.step_begins(step + 1)  # commits a finished background save
            lr = lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup,
                       total_steps=t.steps, decay=t.decay, wsd_decay_fraction=t.wsd_decay_fraction)  # fmt: skip
            with timer.phase("data"):
                batches = _microbatches(train_set, sampler, plan.microbatches)
            skipped = False
            try:
                loss, result = runner.train_step(batches, lr, timer=timer, step=step)
            except FloatingPointError as exc:
                # the trainer numbers the steps: the optimizer's own "step N: " is dropped
                why = f"step {step + 1}: {_STEP_PREFIX.sub('', str(exc), count=1)}"
                if t.nan_policy != "skip":
                    raise TrainingError(why) from None
                console.print(f"{why} (skipped)", markup=False)
                runner.discard_step()
                skipped = True
            step, consumed = step + 1, consumed + t.global_batch_size
            window_steps += 0 if skipped else 1
            if not skipped and (step % t.log_interval == 0 or step == t.steps):
                value = float(loss)
                if not math.isfinite(value):
                    raise TrainingError(
                        f"step {step}: the loss is {value}; lower train.lr or set train.nan_policy skip"
                    )
                if device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - window_start
                tok_s = window_steps * tokens_per_step / elapsed
                tflops = tok_s * flops_token / world / 1e12
                record = {"loss": value, "lr": lr, "grad_norm": float(result.grad_norm or 0.0),
                          "tokens_per_s": tok_s, "tflops_per_gpu": tflops,
                          "step_ms": 1e3 * elapsed / window_steps,
                          **timer.take(window_steps)}  # fmt: skip
                if peak:
                    record["mfu"] = tflops / peak
                if device.type == "cuda":
                    record["mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                record.update(moe_log_values(built.chunks, groups))  # collective; {} when dense
                record.update(mtp_log_values(runner.last_losses, groups))  # collective; {} no MTP
                record.update(runner.fp8_log_values())  # {} without delayed fp8 scaling
                metrics.log(step, record)
                losses.append(value)
                eta = (t.steps - step) * elapsed / window_steps
                mfu = f" mfu {record['mfu']:.1%}" if "mfu" in record else ""
                if "moe_imbalance" in record:
                    mfu += f"  moe aux {record['moe_aux_loss']:.3f} imbalance {record['moe_imbalance']:.2f}"
                if "mtp_loss" in record:
                    mfu += f"  mtp {record['mtp_loss']:.4f}"
                if "fp8_overshoot_input" in record:  # above 1: delayed scales saturated
                    mfu += (
                        f"  fp8 overshoot {record['fp8_overshoot_input']:.2f}"
                        f"/{record['fp8_overshoot_grad']:.2f}"
                    )
                console.print(
                    f"step {step:>6}/{t.steps}  loss {value:7.4f}  lr {lr:.2e}  "
                    f"grad {record['grad_norm']:.3f}  {tok_s:,.0f} tok/s{mfu}  "
                    f"{breakdown_text(record)}  eta {eta:5.0f}s"
                )
                live.advance(step, f"loss {value:.4f}  lr {lr:.2e}  {tok_s:,.0f} tok/s{mfu}")
                window_start, window_steps = time.perf_counter(), 0
            live.advance(step)
            if (
                not skipped
                and valid_set is not None
                and t.eval_interval
                and step % t.eval_interval == 0
            ):
                _evaluate(runner, valid_set, config, dp_rank, dp, metrics, step, console)
            if stop.requested():
                stopped_by = stop.signal_name or "signal"
                break
            if t.exit_interval and step % t.exit_interval == 0 and step < t.steps:
                stopped_by = "exit_interval"
                break
            if (
                config.checkpoint.save_interval
                and step % config.checkpoint.save_interval == 0
                and step < t.steps
            ):
                saved = save(step, consumed)
        saved = save(step, consumed)
        saved = saver.finish() or saved  # the background write, committed
        if rank0:  # committed: a launcher may trust this, not torchrun's exit code
            write_run_end(
                run_dir, stopped_by=stopped_by, step=step, steps=t.steps, checkpoint=saved
            )
    finally:
        saver.close()
        live.__exit__(None, None, None)
        stop.restore()
        metrics.close()
    total = time.perf_counter() - run_start
    rate = (step - first_step) * tokens_per_step / total if total > 0 else 0.0
    how = f"stopped by {stopped_by}" if stopped_by else "done"
    final = f"final loss {losses[-1]:.4f}, " if losses else ""
    console.print(
        f"[bold]{how}[/bold]: step {step}, {final}{rate:,.0f} tok/s overall, checkpoint {saved}"
    )
    return RunSummary(run_dir, first_step, step, losses, rate, stopped_by, saved)


_STEP_PREFIX = re.compile(r"^step \d+: ")


def _completed_step(config: TrainerConfig, source: Path | None) -> int | None:
    """The step of the checkpoint to resume from when it already finished this run's
    ``train.steps`` (nothing is left to do), else None; one sentence when it went past them."""
    if source is None or not source.is_dir():
        return None
    try:
        step = int(read_meta(source)["step"])
    except CheckpointError:
        return None  # load_checkpoint says what is wrong with it
    if step < config.train.steps:
        return None
    check_resume(None, config, step, 0, source)  # raises past train.steps
    return step


def _schedule_change(saved: Any, config: TrainerConfig) -> str | None:
    """One line when a resume changes ``train.steps``, which stretches or shrinks the decay
    of the learning-rate schedule under the steps still to run."""
    old = saved.get("train", {}).get("steps") if isinstance(saved, dict) else None
    new = config.train.steps
    if not isinstance(old, int) or old == new:
        return None
    return (
        f"train.steps changed on resume: {old} -> {new}; the {config.train.decay} learning-rate "
        f"schedule now runs over {new} steps"
    )


def _state(config: TrainerConfig, step: int, consumed: int) -> dict[str, Any]:
    return {"step": step, "consumed_samples": consumed, "config": config_to_dict(config)}


def _resume_source(config: TrainerConfig, run_dir: Path) -> Path | None:
    load = config.checkpoint.load
    if load == "none":
        return None
    if load == "auto":
        return latest_checkpoint(run_dir)
    return Path(load)


#: settings that decide which samples a step reads: a resumed run must keep them
_DATA_ORDER = (("train", "seq_len"), ("train", "seed"), ("data", "paths"),
               ("data", "weights"), ("data", "valid_fraction"))  # fmt: skip


def check_resume(saved: Any, config: TrainerConfig, step: int, consumed: int, source: Path) -> None:
    """Raise ValueError (one sentence) when resuming ``source`` with this config cannot
    continue the run: the data order would change under samples already consumed, or the
    run has no steps left. (A checkpoint that consumed nothing, e.g. one converted from
    Hugging Face, starts on any data.)"""
    if step > config.train.steps:
        raise ValueError(
            f"the checkpoint {source} is at step {step} but train.steps is "
            f"{config.train.steps}; raise train.steps, or start a new run (another run.name "
            "or checkpoint.load none)"
        )
    if not isinstance(saved, dict) or consumed == 0:
        return
    mine = config_to_dict(config)
    for section, key in _DATA_ORDER:
        recorded = saved.get(section, {})
        if key not in recorded:  # a checkpoint from before the setting existed
            continue
        old, new = recorded[key], mine[section][key]
        before = list(old) if isinstance(old, list | tuple) else old
        now = list(new) if isinstance(new, list | tuple) else new
        if before != now:
            raise ValueError(
                f"the checkpoint {source} was trained with {section}.{key} {before!r} but this "
                f"run has {now!r}, which changes the order of the samples it continues from; "
                f"resume with {before!r}, or start a new run (another run.name or "
                "checkpoint.load none)"
            )


def _warn_if_no_evaluation(
    valid_set: Any, config: TrainerConfig, dp: int, console: Console
) -> None:
    """Say once, up front, when evaluation is on but the validation split holds fewer samples
    than one evaluation step takes (one micro-batch per dp rank, pp of them under vpp)."""
    t, p = config.train, config.parallel
    need = t.micro_batch_size * dp * (p.pp if p.vpp else 1)
    if valid_set is not None and t.eval_interval and len(valid_set) < need:
        console.print(
            f"[yellow]evaluation skipped: the validation split has {len(valid_set)} samples, "
            f"fewer than the {need} one evaluation takes; raise data.valid_fraction or set "
            "train.eval_interval 0[/yellow]"
        )


def _evaluate(
    runner: StepRunner, valid_set: Any, config: TrainerConfig, dp_rank: int, dp: int,
    metrics: MetricsLogger, step: int, console: Console,
) -> None:  # fmt: skip
    t, p = config.train, config.parallel
    count = min(t.eval_steps, len(valid_set) // (t.micro_batch_size * dp))
    if p.vpp:  # the interleaved schedule runs a multiple of pp micro-batches
        count -= count % p.pp
    if count == 0:  # said once, before the first step (_warn_if_no_evaluation)
        return
    sampler = iter(DistributedBatchSampler(len(valid_set), 0, t.micro_batch_size, dp_rank, dp))
    loss = float(runner.eval_step(_microbatches(valid_set, sampler, count)))
    metrics.log(step, {"loss": loss, "ppl": math.exp(min(loss, 50.0))}, kind="valid")
    console.print(f"step {step:>6}  [cyan]valid loss {loss:.4f}[/cyan]")
