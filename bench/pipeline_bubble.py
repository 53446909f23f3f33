"""Pipeline bubble of mega-pipeline's 1F1B (v=1) and interleaved (v=2) schedules at pp=2.

On the GPU machine, from the source tree:

    export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --nproc-per-node 2 bench/pipeline_bubble.py

Smoke run on CPU (gloo, tiny sizes, meaningless numbers):

    uv run torchrun --nproc-per-node 2 bench/pipeline_bubble.py --smoke

A stack of ``--layers`` bf16 Linear(h, h) + ReLU layers is split into pp*v stages. For
each v in {1, 2} and m in {2, 4, 8, 16}, one training step (m microbatches) is timed
(median over ``--iters`` steps after ``--warmup``), and the measured bubble
``1 - ideal / step`` is printed beside the theory ``(p-1) / (v*m + p-1)``, where
``ideal = m * (sum over the rank's chunks of one chunk's forward+backward time,
measured alone on its GPU)``, taken on the busiest rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_pipeline import P2PCommunicator, StageChunk, get_forward_backward_func, rank_layer_ranges


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="gloo on CPU, tiny sizes, 1 step")
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=4096, help="seq * micro_batch per microbatch")
    parser.add_argument("--layers", type=int, default=8, help="layers of the whole model")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--vpp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8, 16])
    args = parser.parse_args()
    if args.smoke:
        args.hidden, args.tokens, args.warmup, args.iters = 32, 16, 1, 1
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _chunk_alone_ms(
    chunk: nn.Module, x: Tensor, stage: int, stages: int, warmup: int, iters: int
) -> float:
    """Forward + backward of one chunk on one microbatch as the pipeline runs it, alone."""
    device, last = x.device, stage == stages - 1
    grad = torch.randn_like(x)
    times = []
    for i in range(warmup + iters):
        inp = x.detach().requires_grad_(stage > 0)  # the first stage needs no input gradient
        _sync(device)
        t0 = time.perf_counter()
        out = chunk(inp)
        if last:
            out.float().pow(2).mean().backward()
        else:
            out.backward(grad)
        _sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    chunk.zero_grad(set_to_none=True)
    return statistics.median(times)


def _forward_step(
    x: Tensor,
) -> Callable[[Any, StageChunk], tuple[Tensor, Callable[[Tensor], Tensor]]]:
    def step(_: Any, chunk: StageChunk) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
        out = chunk(x)  # on a later stage the received activation replaces x
        return out, lambda o: o.float().pow(2).mean()

    return step


def _max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def main() -> None:
    args = _args()
    backend = "gloo" if args.smoke or not torch.cuda.is_available() else "nccl"
    groups = init_process_groups(ParallelConfig(pp=int(os.environ["WORLD_SIZE"])), backend=backend)
    pp, rank = groups.size("pp"), groups.rank("pp")
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    dtype = torch.bfloat16 if backend == "nccl" else torch.float32
    h, tokens = args.hidden, args.tokens
    shape = (tokens, 1, h)  # [s, b, h]
    comm = P2PCommunicator(groups.pp, tensor_shape=shape, dtype=dtype)
    x = torch.randn(shape, device=device, dtype=dtype)
    rows = []
    for vpp in args.vpp:
        torch.manual_seed(0)
        chunks = [
            nn.Sequential(*[m for _ in r for m in (nn.Linear(h, h, bias=False), nn.ReLU())]).to(
                device=device, dtype=dtype
            )
            for r in rank_layer_ranges(args.layers, pp, rank, vpp)
        ]
        alone = sum(
            _chunk_alone_ms(c, x, i * pp + rank, pp * vpp, args.warmup, max(args.iters, 3))
            for i, c in enumerate(chunks)
        )
        alone = _max(alone, device)  # the busiest rank sets the ideal time
        schedule = get_forward_backward_func(pp, vpp)
        for m in args.microbatches:
            if vpp > 1 and m % pp:
                continue
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times = []
            for i in range(args.warmup + args.iters):
                dist.barrier(group=groups.pp)
                _sync(device)
                t0 = time.perf_counter()
                schedule(
                    forward_step=_forward_step(x),
                    data_iterator=[None] * vpp if vpp > 1 else None,
                    model=chunks if vpp > 1 else chunks[0],
                    num_microbatches=m,
                    communicator=comm,
                )
                _sync(device)
                elapsed = (time.perf_counter() - t0) * 1e3
                for c in chunks:
                    c.zero_grad(set_to_none=True)
                if i >= args.warmup:
                    times.append(_max(elapsed, device))
            step = statistics.median(times)
            ideal = m * alone
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
            peak = _max(peak, device)
            theory = (pp - 1) / (vpp * m + pp - 1)
            rows.append((vpp, m, alone, ideal, step, 1 - ideal / step, theory, peak))
    if dist.get_rank() == 0:
        print(
            f"\npp={pp}  hidden={h}  tokens/microbatch={tokens}  layers={args.layers}  "
            f"{dtype}  {backend}  median of {args.iters} steps after {args.warmup} warm-up"
        )
        print(
            f"{'v':>2} {'m':>3} {'chunks F+B ms':>13} {'ideal ms':>9} {'step ms':>9} "
            f"{'bubble':>7} {'theory':>7} {'peak GiB':>8}"
        )
        for vpp, m, alone, ideal, step, bubble, theory, peak in rows:
            print(
                f"{vpp:>2} {m:>3} {alone:>13.2f} {ideal:>9.2f} {step:>9.2f} "
                f"{bubble:>7.3f} {theory:>7.3f} {peak:>8.2f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
