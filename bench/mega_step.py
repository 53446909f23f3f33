"""mega's training step on one GPU (or a torchrun group), side by side with the anchors.

    python3 bench/mega_step.py --size 1b-bench --mb 8 [--compile]      # one GPU
    torchrun --nproc-per-node 2 bench/mega_step.py --size 1b-bench --tp 2 --sp
    python3 bench/mega_step.py --smoke                                   # CPU, tiny
    python3 bench/mega_step.py --size 1b-bench --mb 8 --fp8              # FP8 linear GEMMs
    torchrun --nproc-per-node 2 bench/mega_step.py --tp 2 --sp --tp-comm-overlap  # collective matmul

Runs the trainer's own build (GPTModel, mega-zero-optim DDP + distributed optimizer with
fp32 master weights and fused AdamW, bf16 parameters) and step (mega-pipeline schedule),
on random tokens; 5 warm-up steps, then 20 timed with CUDA events; the median is reported.
Appends one JSON line in the anchors' schema to $OUT/results.jsonl and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from mega_parallel_grid import init_process_groups
from mega_pretrain.build import build, param_dtype
from mega_pretrain.config import load_config
from mega_pretrain.plan import plan_for
from mega_pretrain.runtime import (
    collective_timeout,
    configure_attention_kernel,
    start_distributed,
)
from mega_pretrain.step import StepRunner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1b-bench")
    ap.add_argument("--mb", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step per dp rank")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--pp-layers", default="", help="layers per virtual stage, e.g. 13,11")
    ap.add_argument("--ep", type=int, default=1, help="expert parallel (MoE sizes)")
    ap.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default: tp)")
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--recompute", default="none")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument(
        "--profile", type=int, default=0, metavar="N",
        help="after the timed steps, N more under torch.profiler: kernel time per step by kind "
        "(bench/kernel_profile.py's summary) printed and written to $OUT/profile_<size>.txt",
    )  # fmt: skip
    ap.add_argument("--fp8", action="store_true", help="train.fp8 true (bf16 + FP8 GEMMs)")
    ap.add_argument("--tag", default="", help="appended to the result's system name")
    ap.add_argument("--precision", default="", help="train.precision (default: bf16 on GPU)")
    ap.add_argument(
        "--tp-comm-overlap", action="store_true",
        help="parallel.tp_comm_overlap true (needs --sp): SP collectives overlapped with GEMMs",
    )  # fmt: skip
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="any other config override, e.g. --set parallel.sharding=parameters (repeatable)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.smoke:
        args.size, args.mb, args.seq, args.steps, args.warmup = "tiny", 2, 64, 2, 1
    cuda = torch.cuda.is_available()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if cuda
        else torch.device("cpu")
    )
    start_distributed(device, collective_timeout(10))
    world = dist.get_world_size()
    overrides = [
        ("model.size", args.size), ("train.seq_len", str(args.seq)),
        ("train.micro_batch_size", str(args.mb)),
        ("train.precision", args.precision or ("bf16" if cuda or args.fp8 else "fp32")), ("train.fp8", str(args.fp8).lower()),
        ("train.compile", str(args.compile).lower()),
        ("train.recompute", args.recompute), ("parallel.tp", str(args.tp)), ("parallel.pp", str(args.pp)),
        ("parallel.ep", str(args.ep)), ("parallel.etp", str(args.etp).lower()),
        ("parallel.pp_layers", args.pp_layers),
        ("parallel.sequence_parallel", str(args.sp).lower()),
        ("parallel.tp_comm_overlap", str(args.tp_comm_overlap).lower()),
    ]  # fmt: skip
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--set {item!r} is not KEY=VALUE")
        overrides.append((key, value))
    config = load_config(None, overrides)
    if args.compile and hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        # a layer past dynamo's recompile limit would run eagerly, silently
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    dp = plan_for(config, world).dp  # the layout's dp sets the global batch
    batch = args.mb * args.accum * dp
    config = replace(config, train=replace(config.train, global_batch_size=batch))
    plan = plan_for(config, world)  # the model's family spec, dp and stage split
    model = plan.model
    groups = init_process_groups(plan.parallel)
    configure_attention_kernel(device, config.train.attention_kernel)
    built = build(config, groups, device)
    runner = StepRunner(
        built, groups, seq_len=args.seq, micro_batch_size=args.mb, hidden_size=model.hidden_size,
        dtype=param_dtype(config), device=device, sequence_parallel=args.sp,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1 + groups.rank("dp"))
    batches = []
    for _ in range(args.accum):
        tokens = torch.randint(0, model.vocab_size, (args.mb, args.seq + 1), generator=gen)
        batches.append(
            (
                tokens[:, :-1].pin_memory() if cuda else tokens[:, :-1],
                tokens[:, 1:].pin_memory() if cuda else tokens[:, 1:],
            )
        )
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        loss, _ = runner.train_step(batches, 3e-4)
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss, _ = runner.train_step(batches, 3e-4)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            s = time.perf_counter()
            loss, _ = runner.train_step(batches, 3e-4)
            times.append(1e3 * (time.perf_counter() - s))
    profiled, every_kernel = (
        _profile(runner, batches, args.profile, args.size) if args.profile else ("", "")
    )
    med = statistics.median(times)
    tokens = plan.tokens_per_step
    flops = plan.flops_per_token()  # the family's count: hybrid sizes get their own
    tok_s = tokens / (med / 1e3)
    result = {
        "system": f"mega{'-compile' if args.compile else '-eager'}{'-fp8' if args.fp8 else ''}"
        + "".join(f" {item}" for item in args.set) + (f" {args.tag}" if args.tag else ""),
        "size": args.size, "mb": args.mb, "accum": args.accum,
        "tp": args.tp, "pp": args.pp, "pp_layers": args.pp_layers, "ep": args.ep, "dp": dp, "sp": args.sp, "world": world,
        "tp_comm_overlap": args.tp_comm_overlap,
        "tokens_per_s": tok_s, "tokens_per_s_per_gpu": tok_s / world, "step_ms_median": med,
        "step_ms_min": min(times), "step_ms_max": max(times), "flops_per_token": flops,
        "model_tflops": tok_s * flops / world / 1e12, "loss": float(loss), "warmup_s": first_s,
        "peak_alloc_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else 0.0,
        "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
    }  # fmt: skip
    if dist.get_rank() == 0:
        line = json.dumps(result, sort_keys=True)
        print("RESULT " + line, flush=True)
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "results.jsonl"), "a") as f:
                f.write(line + "\n")
        if profiled:
            print(profiled, flush=True)
            if out:
                tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", result["system"])
                name = f"profile_{args.size}_{tag}.txt"  # every kernel, not only the top 20
                with open(os.path.join(out, name), "w") as f:
                    f.write(every_kernel + "\n")
    dist.destroy_process_group()


def _profile(runner: StepRunner, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int,
             label: str) -> tuple[str, str]:  # fmt: skip
    """Kernel time per step by kind over ``steps`` steady-state steps: the top 20 kernels,
    and every kernel."""
    from kernel_profile import summary
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.train_step(batches, 3e-4)
        if cuda:
            torch.cuda.synchronize()
    return summary(prof, steps, label, cuda), summary(prof, steps, label, cuda, top=10**6)


if __name__ == "__main__":
    main()
