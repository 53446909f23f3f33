"""The MoE layer of mega_moe: tokens/s at ep=1 and ep=2, GroupedMLP vs SequentialMLP.

On the GPU machine, from the repository root (bf16, NCCL; the table prints last, rank 0):

    export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
    python3 bench/moe_layer.py                          # ep=1: one GPU holds all 64 experts
    torchrun --nproc-per-node 2 bench/moe_layer.py      # ep=2: 32 experts per GPU

Here (CPU, gloo, tiny sizes; only checks that the script runs):

    uv run torchrun --nproc-per-node 2 bench/moe_layer.py --smoke

Layer: 64 experts, top-8 (softmax over the chosen logits), hidden 2048, SwiGLU experts of
ffn 1024 each, no shared expert, no token dropping; 16384 tokens per GPU ([s, b, h] =
[4096, 4, 2048]); switch aux loss 1e-2 added to the loss. One step = forward + backward.
Every dispatcher (all-to-all, all-gather) x expert implementation (grouped, sequential)
is timed: warm-up, then the median of CUDA-event timings. tokens/s counts the tokens of
all GPUs; TFLOP/s per GPU counts only activated experts (mega_moe.moe_flops_per_token,
x3 for backward). With $OUT set, each row is also appended as JSON to $OUT/moe_layer.jsonl.
"""

from __future__ import annotations

import os

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
from dataclasses import asdict, dataclass  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _world import init_world  # noqa: E402

from mega_moe import (  # noqa: E402
    GroupedMLP,
    MoEConfig,
    MoELayer,
    RouterConfig,
    moe_flops_per_token,
)
from mega_parallel_grid import ParallelConfig, ProcessGroups, init_process_groups  # noqa: E402


@dataclass
class Row:
    dispatcher: str
    experts: str
    grouped_mm: bool
    ep: int
    num_experts: int
    top_k: int
    hidden: int
    ffn: int
    tokens_per_gpu: int
    dtype: str
    fwd_ms: float
    step_ms: float
    tokens_per_s: float
    tflops_per_gpu: float
    peak_gib: float
    max_load: float
    device: str


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny sizes, 2 iterations")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1024, help="intermediate size of one expert")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--dispatchers", default="alltoall,allgather")
    p.add_argument("--impls", default="grouped,sequential")
    args = p.parse_args()
    if args.smoke:
        args.experts, args.topk, args.hidden, args.ffn = 8, 2, 32, 32
        args.seq, args.batch, args.warmup, args.iters = 16, 2, 1, 2
    return args


def _bench(
    dispatcher: str, impl: str, groups: ProcessGroups, args: argparse.Namespace,
    device: torch.device,
) -> Row:  # fmt: skip
    world = dist.get_world_size()
    dtype = torch.float32 if args.smoke else torch.bfloat16
    router = RouterConfig(num_experts=args.experts, top_k=args.topk, aux_loss_coeff=1e-2)
    cfg = MoEConfig(
        router=router,
        ffn_hidden_size=args.ffn,
        dispatcher=dispatcher,  # type: ignore[arg-type]
        experts=impl,  # type: ignore[arg-type]
    )
    layer = MoELayer(
        args.hidden, cfg, ep_group=groups.ep, etp_group=groups.etp, seed=0, name="moe",
        dtype=dtype, device=device,
    )  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
    shape = (args.seq, args.batch, args.hidden)
    x = torch.randn(shape, generator=gen, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(shape, generator=gen, device=device, dtype=dtype)

    def fwd() -> torch.Tensor:
        out = layer(x)
        assert layer.last_stats is not None
        return (out.float() * dy).sum() + layer.last_stats.loss

    def step() -> None:
        fwd().backward()
        x.grad = None
        layer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    fwd_ms, step_ms = [], []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.iters):
        dist.barrier()
        for times, run in ((fwd_ms, fwd), (step_ms, step)):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                run()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                run()
                times.append((time.perf_counter() - t0) * 1e3)
    # the slowest rank sets the pace: take the max over ranks of each median
    medians = torch.tensor([statistics.median(fwd_ms), statistics.median(step_ms)], device=device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    f_ms, s_ms = medians.tolist()
    tokens = args.seq * args.batch
    stats = layer.last_stats
    assert stats is not None
    load = stats.tokens_per_expert.float()
    flops = moe_flops_per_token(args.hidden, cfg, backward=True) * tokens
    experts = layer.experts
    probe = torch.empty(1, args.hidden, dtype=dtype, device=device)
    fast = isinstance(experts, GroupedMLP) and experts.uses_grouped_mm(probe)
    return Row(
        dispatcher=dispatcher, experts=impl, grouped_mm=fast, ep=world,
        num_experts=args.experts, top_k=args.topk, hidden=args.hidden, ffn=args.ffn,
        tokens_per_gpu=tokens, dtype=str(dtype).removeprefix("torch."), fwd_ms=f_ms,
        step_ms=s_ms, tokens_per_s=tokens * world / (s_ms / 1e3),
        tflops_per_gpu=flops / (s_ms / 1e3) / 1e12,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        max_load=float(load.max() / load.mean()),
        device=torch.cuda.get_device_name() if cuda else "cpu",
    )  # fmt: skip


def main() -> None:
    args = _parse()
    device = init_world(args.smoke)
    groups = init_process_groups(ParallelConfig(ep=dist.get_world_size(), etp=1))
    rows = [
        _bench(d, impl, groups, args, device)
        for d in args.dispatchers.split(",")
        for impl in args.impls.split(",")
    ]
    if dist.get_rank() == 0:
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "moe_layer.jsonl"), "a") as f:
                for r in rows:
                    f.write(json.dumps(asdict(r)) + "\n")
        r0 = rows[0]
        print(
            f"\nMoE layer: E={r0.num_experts} top-{r0.top_k} h={r0.hidden} ffn={r0.ffn} "
            f"SwiGLU, {r0.tokens_per_gpu} tokens/GPU, {r0.dtype}, ep={r0.ep}, {r0.device}"
        )
        print(
            f"{'dispatcher':<10} {'experts':<10} {'gmm':>3} {'fwd ms':>8} {'step ms':>8} "
            f"{'tokens/s':>11} {'TFLOP/s/GPU':>11} {'peak GiB':>8} {'load max/mean':>13}"
        )
        for r in rows:
            print(
                f"{r.dispatcher:<10} {r.experts:<10} {'y' if r.grouped_mm else 'n':>3} "
                f"{r.fwd_ms:>8.2f} {r.step_ms:>8.2f} {r.tokens_per_s:>11.0f} "
                f"{r.tflops_per_gpu:>11.1f} {r.peak_gib:>8.1f} {r.max_load:>13.2f}"
            )
        for d in args.dispatchers.split(","):
            by = {r.experts: r for r in rows if r.dispatcher == d}
            if "grouped" in by and "sequential" in by:
                speedup = by["sequential"].step_ms / by["grouped"].step_ms
                print(f"{d}: GroupedMLP speed-up over SequentialMLP (step time): {speedup:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
