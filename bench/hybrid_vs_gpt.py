"""A ~1B hybrid (Mamba-2 + attention + MLP) beside the GPT "1b" size: tokens/s on one GPU.

On the GPU machine, from the repository root (bf16, one GPU; the table prints last):

    export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
    python3 bench/hybrid_vs_gpt.py                       # seq 2048, micro-batch 4
    python3 bench/hybrid_vs_gpt.py --recompute selective # SSD scans and attention cores recomputed

Under torchrun each rank measures on its own GPU (tp = 1) and rank 0 prints its figures.
Here (CPU, gloo, tiny sizes; only checks that the script runs):

    uv run torchrun --nproc-per-node 2 bench/hybrid_vs_gpt.py --smoke

One step = forward + backward of the mean token loss + a fused AdamW step, all in bf16
(weights, gradients and Adam state), no gradient accumulation. Time is the median of
``--iters`` steps after ``--warmup``, from CUDA events. MFU uses each size's family spec
(``spec_for(size).flops_per_token``: GPT's, or the hybrid's with the SSD) against the H200's dense bf16
peak of 989 TFLOP/s. With $OUT set, each row is also appended as JSON to
$OUT/hybrid_vs_gpt.jsonl.
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
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _world import init_world  # noqa: E402
from torch import nn  # noqa: E402

from mega_models.spec import spec_for  # noqa: E402
from mega_parallel_grid.testing import solo_groups  # noqa: E402

PEAK_BF16_TFLOPS = 989.0  # H200 SXM dense bf16


@dataclass
class Row:
    model: str
    pattern: str
    params_m: float
    seq: int
    batch: int
    dtype: str
    recompute: str
    compiled: bool
    tf32: bool
    step_ms: float
    tokens_per_s: float
    tflops: float
    mfu: float
    peak_gib: float
    loss: float
    device: str


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny sizes, 2 iterations")
    p.add_argument("--gpt", default="1b", help="GPT size name (mega_models.MODEL_SIZES)")
    p.add_argument("--hybrid", default="hybrid-1b", help="hybrid size name (HYBRID_SIZES)")
    p.add_argument("--pattern", default=None, help="override the hybrid's layer pattern")
    p.add_argument(
        "--mixer-kernel",
        default=None,
        choices=["auto", "triton", "torch"],
        help="override the hybrid's mixer_kernel (conv + SiLU, gated norm)",
    )
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    p.add_argument("--only", choices=["gpt", "hybrid"], default=None, help="run one model only")
    p.add_argument("--compile", action="store_true", help="torch.compile both models")
    p.add_argument("--tf32", action="store_true", help="TF32 for fp32 matmuls (the SSD's)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="print each model's kernel time by kind and top kernels (one step)",
    )
    args = p.parse_args()
    if args.smoke:
        args.gpt, args.hybrid, args.seq, args.batch = "tiny", "hybrid-tiny", 32, 2
        args.warmup, args.iters = 1, 2
    return args


def _bench(name: str, args: argparse.Namespace, device: torch.device) -> Row:
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model: nn.Module
    size = args.gpt if name == "gpt" else args.hybrid
    spec = spec_for(size)  # the family's model class and FLOPs per token
    config = spec.sizes[size]
    if name != "gpt" and args.pattern is not None:
        config = config.replace(pattern=args.pattern)
    if name != "gpt" and args.mixer_kernel is not None:
        config = config.replace(mixer_kernel=args.mixer_kernel)
    model = spec.model_class(config, solo_groups(), recompute=args.recompute, seed=1,
                             device=device, dtype=dtype)  # fmt: skip
    pattern = getattr(config, "pattern", f"*-  x{config.num_layers}")
    label, flops = size, spec.flops_per_token(config, args.seq)
    vocab = config.vocab_size
    params = sum(p.numel() for p in model.parameters())
    if args.compile:
        model = torch.compile(model)  # type: ignore[assignment]
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **fused)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen).to(device)
    ids, labels = tokens[:, :-1], tokens[:, 1:]

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = model(ids, labels).float().mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step()
    times = []
    loss = torch.zeros(())
    if device.type == "cuda":
        torch.cuda.synchronize()
        marks = [
            [torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(args.iters)
        ]
        for m in marks:
            m[0].record()
            loss = step()
            m[1].record()
        torch.cuda.synchronize()
        times = [m[0].elapsed_time(m[1]) for m in marks]
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        dev_name = torch.cuda.get_device_name(device)
    else:
        for _ in range(args.iters):
            t0 = time.perf_counter()
            loss = step()
            times.append((time.perf_counter() - t0) * 1e3)
        peak, dev_name = 0.0, "cpu"
    step_ms = statistics.median(times)
    if args.profile and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        from kernel_profile import summary

        print(summary(prof, 1, f"{label} (one step)"), flush=True)
    tokens_per_s = args.batch * args.seq / (step_ms * 1e-3)
    tflops = flops * tokens_per_s / 1e12
    row = Row(label, pattern, params / 1e6, args.seq, args.batch, str(dtype).removeprefix("torch."),
              args.recompute, args.compile, args.tf32, step_ms, tokens_per_s, tflops, tflops / PEAK_BF16_TFLOPS,
              peak, float(loss), dev_name)  # fmt: skip
    return row


def main() -> None:
    args = _parse()
    device = init_world(args.smoke)
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    names = [args.only] if args.only else ["gpt", "hybrid"]
    rows = []
    for name in names:
        rows.append(_bench(name, args, device))
        gc.collect()  # the model and its optimizer state go before the next one is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    if dist.get_rank() == 0:
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "hybrid_vs_gpt.jsonl"), "a") as f:
                for r in rows:
                    f.write(json.dumps(asdict(r)) + "\n")
        print(f"\nfwd+bwd+AdamW, seq {args.seq} x micro-batch {args.batch}, {rows[0].dtype}, "
              f"recompute {args.recompute}, compile {args.compile}, tf32 {args.tf32}, {rows[0].device}, "
              f"median of {args.iters}")  # fmt: skip
        print(f"{'model':>11} {'params M':>9} {'step ms':>9} {'tokens/s':>10} {'TFLOP/s':>8} "
              f"{'MFU':>6} {'peak GiB':>9} {'loss':>7}  pattern")  # fmt: skip
        for r in rows:
            print(f"{r.model:>11} {r.params_m:>9.1f} {r.step_ms:>9.2f} {r.tokens_per_s:>10.0f} "
                  f"{r.tflops:>8.1f} {r.mfu:>6.1%} {r.peak_gib:>9.2f} {r.loss:>7.3f}  {r.pattern}")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
