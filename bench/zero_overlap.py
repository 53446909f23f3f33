"""How much of the data-parallel communication the overlap hides: mega_zero_optim at dp=2.

A stack of ``--layers`` Linear(hidden, hidden) layers (default 15 x 8192^2 = 1.0e9 parameters,
bf16, fp32 gradient buffers, AdamW on fp32 master shards) trained at dp = the world size.
Measured (median over ``--iters`` after ``--warmup``, max over ranks, wall clock between
device synchronisations):

- forward + backward alone (inside ``no_sync``: no communication)
- forward + backward + gradient sync, without and with ``overlap_grad_reduce``
- the gradient reduce-scatter alone, and the parameter all-gather alone
- the optimizer step (math + all-gather), and whole iterations with no overlap and with
  both overlaps (gradient reduce-scatter in backward, parameter all-gather in forward)

Exposed communication = measured time - the same work without communication.

On the 2-GPU machine, from the repository root:

    export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --nproc-per-node 2 bench/zero_overlap.py

CPU smoke run (gloo, tiny sizes): ``uv run torchrun --nproc-per-node 2 bench/zero_overlap.py --smoke``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from mega_zero_optim import DistributedDataParallel, DistributedOptimizer


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--layers", type=int, default=15)
    p.add_argument("--tokens", type=int, default=8192, help="rows of the input per rank")
    p.add_argument("--bucket-size", type=int, default=40_000_000, help="elements per bucket")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="gloo on CPU, tiny sizes, 2 iterations")
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.tokens = 64, 4, 32
        args.bucket_size, args.warmup, args.iters = 3000, 1, 2
    return args


def _setup(smoke: bool) -> torch.device:
    if smoke or not torch.cuda.is_available():
        dist.init_process_group("gloo")
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return torch.device("cuda", local)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(
    device: torch.device,
    args: argparse.Namespace,
    run: Callable[[], None],
    prepare: Callable[[], None] | None = None,
) -> float:
    """Median milliseconds of ``run`` (``prepare`` runs untimed before each), max over ranks."""
    times = []
    for i in range(args.warmup + args.iters):
        if prepare is not None:
            prepare()
        _sync(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    worst = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def _build(
    args: argparse.Namespace, device: torch.device, overlap: bool
) -> tuple[DistributedDataParallel, DistributedOptimizer]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.hidden, args.hidden, bias=False), nn.GELU()]
    net = nn.Sequential(*layers).to(device=device, dtype=torch.bfloat16)
    ddp = DistributedDataParallel(
        net,
        dp_group=dist.group.WORLD,  # type: ignore[arg-type]
        bucket_size=args.bucket_size,
        overlap_grad_reduce=overlap,
        grad_dtype=torch.float32,
    )
    adamw = torch.optim.AdamW(ddp.parameters(), lr=1e-5, weight_decay=0.1)
    return ddp, DistributedOptimizer(adamw, ddp, max_grad_norm=1.0, overlap_param_gather=overlap)


def _consecutive(device: torch.device, args: argparse.Namespace, run: Callable[[], None]) -> float:
    """Mean milliseconds per call over ``--iters`` back-to-back calls (steady state), max over ranks.

    No synchronisation between calls, so work a call leaves in flight (the overlapped
    parameter all-gather) overlaps the next call as it would in training.
    """
    for _ in range(args.warmup):
        run()
    _sync(device)
    start = time.perf_counter()
    for _ in range(args.iters):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    worst = torch.tensor([(time.perf_counter() - start) * 1e3 / args.iters], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def main() -> None:
    args = _args()
    device = _setup(args.smoke)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(args.tokens, args.hidden, generator=g, device=device, dtype=torch.bfloat16)

    # --- no overlap: compute alone, communication alone, step, iterations ---------------
    ddp, opt = _build(args, device, overlap=False)

    def fwd_bwd() -> None:
        ddp(x).float().square().mean().backward()

    def compute_only() -> None:
        with ddp.no_sync():
            fwd_bwd()

    def fwd_bwd_sync() -> None:
        fwd_bwd()
        ddp.finish_grad_sync()

    def filled() -> None:  # buffers full of fresh gradients, nothing reduced yet
        opt.zero_grad()
        compute_only()

    def reduced() -> None:
        opt.zero_grad()
        fwd_bwd_sync()

    def gather() -> None:
        ddp.start_param_sync()
        ddp.finish_param_sync()

    def step() -> None:
        opt.step()

    def iteration() -> None:
        opt.zero_grad()
        fwd_bwd()
        opt.step()

    compute = _measure(device, args, compute_only, prepare=opt.zero_grad)
    no_overlap = _measure(device, args, fwd_bwd_sync, prepare=opt.zero_grad)
    reduce_alone = _measure(device, args, ddp.finish_grad_sync, prepare=filled)
    gather_alone = _measure(device, args, gather)
    step_ms = _measure(device, args, step, prepare=reduced)
    iter_plain = _consecutive(device, args, iteration)
    report = opt.memory_report()
    buckets = len(ddp.bucket_info())
    del ddp, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # --- both overlaps (the closures above now see the new ddp and opt) ----------------
    ddp, opt = _build(args, device, overlap=True)
    overlapped = _measure(device, args, fwd_bwd_sync, prepare=opt.zero_grad)
    iter_overlap = _consecutive(device, args, iteration)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0

    math = max(step_ms - gather_alone, 0.0)
    rows = [
        ("fwd+bwd, compute only (no_sync)", compute),
        ("fwd+bwd + grad sync, no overlap", no_overlap),
        ("fwd+bwd + grad sync, overlapped", overlapped),
        ("grad reduce-scatter alone", reduce_alone),
        ("exposed grad comm, no overlap", no_overlap - compute),
        ("exposed grad comm, overlapped", overlapped - compute),
        ("param all-gather alone", gather_alone),
        ("optimizer step (math + all-gather)", step_ms),
        ("iteration, no overlap", iter_plain),
        ("iteration, grad + param-gather overlap", iter_overlap),
        ("exposed comm per iteration, no overlap", iter_plain - compute - math),
        ("exposed comm per iteration, overlapped", iter_overlap - compute - math),
    ]
    if rank == 0:
        print(
            f"zero_overlap: dp={world}, {report.num_params:,} params ({args.layers} x "
            f"Linear({args.hidden}, {args.hidden}), bf16, fp32 grads, AdamW), {args.tokens} "
            f"rows/rank, {buckets} buckets of {args.bucket_size:,} elements, {device.type}, "
            f"torch {torch.__version__}"
        )
        print(f"memory: {report}; peak allocated {peak:.1f} GiB")
        print(
            "exposed = measured - compute only [- (step - all-gather alone)]; "
            f"iterations: mean of {args.iters} back to back, others: median of {args.iters}"
        )
        print(f"| {'measurement':<42} | {'ms':>9} |")
        print(f"|{'-' * 44}|{'-' * 10}:|")
        for name, ms in rows:
            print(f"| {name:<42} | {ms:>9.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
