"""Column -> Row MLP block of mega_tp_layers: step time and TFLOP/s per GPU at tp=1 and tp=2.

On the GPU machine, from the repository root (bf16, NCCL; the table prints last, rank 0):

    export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
    torchrun --nproc-per-node 2 bench/tp_mlp.py     # nn.Linear, tp=1 (each GPU alone), tp=2 SP off/on
    python3 bench/tp_mlp.py                         # nn.Linear and tp=1 only

Here (CPU, gloo, tiny sizes; only checks that the script runs):

    uv run torchrun --nproc-per-node 2 bench/tp_mlp.py --smoke

Block: y = RowParallelLinear(gelu(ColumnParallelLinear(x))), x [s, b, h] (or [s/tp, b, h]
with sequence parallel), no biases. One step = forward + backward (input and weight grads).
FLOPs per step = 12 * s * b * h * ffn (two GEMMs, x3 for backward), divided by tp per GPU.
With $OUT set, each row is also appended as JSON to $OUT/tp_mlp.jsonl.
"""

from __future__ import annotations

import os

# Megatron's rule for the backward overlap: one hardware queue, so the async collective is
# scheduled before the weight-gradient GEMM that follows it. Must be set before CUDA starts.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
for _key, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_key, _value)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _world import init_world  # noqa: E402
from torch import nn  # noqa: E402

from mega_parallel_grid import ParallelConfig, init_process_groups  # noqa: E402
from mega_tp_layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402


@dataclass
class Row:
    impl: str
    tp: int
    sp: bool
    hidden: int
    ffn: int
    tokens: int
    dtype: str
    fwd_ms: float
    bwd_ms: float
    step_ms: float
    tflops_per_gpu: float
    device: str


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny sizes, 2 iterations")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.ffn, args.seq, args.batch = 64, 256, 16, 2
        args.warmup, args.iters, args.dtype = 1, 2, "fp32"
    return args


def _time(
    step_fwd: Callable[[], torch.Tensor],
    step_bwd: Callable[[torch.Tensor], None],
    warmup: int,
    iters: int,
    device: torch.device,
) -> tuple[float, float]:
    """Median forward and backward milliseconds."""
    for _ in range(warmup):
        step_bwd(step_fwd())
    fwd, bwd = [], []
    if device.type == "cuda":
        torch.cuda.synchronize()
        marks = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
        for m in marks:
            m[0].record()
            out = step_fwd()
            m[1].record()
            step_bwd(out)
            m[2].record()
        torch.cuda.synchronize()
        fwd = [m[0].elapsed_time(m[1]) for m in marks]
        bwd = [m[1].elapsed_time(m[2]) for m in marks]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            out = step_fwd()
            t1 = time.perf_counter()
            step_bwd(out)
            t2 = time.perf_counter()
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
    return statistics.median(fwd), statistics.median(bwd)


def _bench(tp: int, sp: bool, args: argparse.Namespace, device: torch.device) -> Row:
    """tp = 0: the plain nn.Linear block, the reference for tp = 1."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    h, ffn = args.hidden, args.ffn
    fc1: nn.Module
    fc2: nn.Module
    if tp == 0:
        fc1 = nn.Linear(h, ffn, bias=False, dtype=dtype, device=device)
        fc2 = nn.Linear(ffn, h, bias=False, dtype=dtype, device=device)
    else:
        group = init_process_groups(ParallelConfig(tp=tp)).tp
        fc1 = ColumnParallelLinear(
            h, ffn, tp_group=group, bias=False, sequence_parallel=sp, seed=0, name="fc1",
            dtype=dtype, device=device,
        )  # fmt: skip
        fc2 = RowParallelLinear(
            ffn, h, tp_group=group, bias=False, sequence_parallel=sp, seed=0, name="fc2",
            dtype=dtype, device=device,
        )  # fmt: skip
    impl, tp = ("nn.Linear", 1) if tp == 0 else ("mega", tp)
    s_local = args.seq // tp if sp else args.seq
    x = torch.randn(s_local, args.batch, h, dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn(s_local, args.batch, h, dtype=dtype, device=device)
    params = [*fc1.parameters(), *fc2.parameters()]

    def forward() -> torch.Tensor:
        for p in params:
            p.grad = None
        x.grad = None
        return fc2(F.gelu(fc1(x)))

    def backward(y: torch.Tensor) -> None:
        y.backward(dy)

    fwd_ms, bwd_ms = _time(forward, backward, args.warmup, args.iters, device)
    tokens = args.seq * args.batch
    flops_per_gpu = 12.0 * tokens * h * ffn / tp
    step_ms = fwd_ms + bwd_ms
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Row(impl, tp, sp, h, ffn, tokens, args.dtype, fwd_ms, bwd_ms, step_ms,
               flops_per_gpu / (step_ms * 1e-3) / 1e12, name)  # fmt: skip


def main() -> None:
    args = _parse()
    device = init_world(args.smoke)
    world, rank = dist.get_world_size(), dist.get_rank()
    configs = [(0, False), (1, False)]
    if world > 1:
        configs += [(world, False), (world, True)]
    if args.seq % world != 0:
        raise SystemExit(f"--seq ({args.seq}) must be divisible by the world size ({world})")
    rows = [_bench(tp, sp, args, device) for tp, sp in configs]
    dist.barrier()
    if rank == 0:
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "tp_mlp.jsonl"), "a") as f:
                for r in rows:
                    f.write(json.dumps(asdict(r)) + "\n")
        base = rows[0].step_ms
        print(f"\nColumn->Row MLP, h={args.hidden} ffn={args.ffn} tokens={args.seq * args.batch} "
              f"({args.seq}x{args.batch}) {args.dtype}, {rows[0].device}, median of {args.iters}")  # fmt: skip
        print(f"{'impl':>9} {'tp':>3} {'sp':>5} {'fwd ms':>9} {'bwd ms':>9} {'step ms':>9} "
              f"{'TFLOP/s/GPU':>12} {'speed-up':>9}")  # fmt: skip
        for r in rows:
            print(f"{r.impl:>9} {r.tp:>3} {r.sp!s:>5} {r.fwd_ms:>9.3f} {r.bwd_ms:>9.3f} {r.step_ms:>9.3f} "
                  f"{r.tflops_per_gpu:>12.2f} {base / r.step_ms:>8.2f}x")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
