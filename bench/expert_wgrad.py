"""The experts' weight gradients into fp32 ``main_grad``: two kernels against one.

    python3 bench/expert_wgrad.py                 # one GPU: deepseek-3b's expert shapes
    python3 bench/expert_wgrad.py --smoke         # CPU (Triton interpreter off): runs

Until 2026-12-06 each micro-batch's expert weight gradient was a grouped GEMM writing bf16
``[E, N, K]`` and then the data-parallel wrapper's accumulation kernel adding it into fp32
``main_grad`` (bf16 write + bf16 read + fp32 read + fp32 write: 12 bytes an element). The
fused kernel (``mega_moe.wgrad_accum``) reads and writes fp32 ``main`` once inside the GEMM
(8 bytes an element, overlapped with the products). ``deepseek-3b``, one MoE layer, one
micro-batch of 4 x 2048 tokens routed top-6 over 64 experts (49,152 rows, the counts drawn
from a skewed multinomial as routing gives):

- ``fc1``: ``dy [M, 1408]^T x [M, 2048]`` per expert (gate and up), 283 GFLOP;
- ``fc2``: ``dy [M, 2048]^T a [M, 704]`` per expert, 142 GFLOP.

Lines: ``grouped_mm`` (the GEMM alone, the floor without accumulation), ``grouped_mm +
accumulate`` (the path until now), ``fused`` (the default blocks) and each block
configuration of ``TUNING``. Each result's error against an fp64 product, as a fraction of the
largest element (the bf16 GEMM output rounds to ~2^-9; fp32 accumulation to ~1e-6).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor


def _time(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()  # type: ignore[no-untyped-call]
    for _ in range(iters):
        fn()
    end.record()  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / iters  # type: ignore[no-untyped-call]


def _counts(rows: int, experts: int, gen: torch.Generator) -> Tensor:
    logits = torch.randn(experts, generator=gen) * 0.5
    picks = torch.multinomial(torch.softmax(logits, 0), rows, replacement=True, generator=gen)
    return torch.bincount(picks, minlength=experts)


def _measure(
    name: str, n: int, k: int, ends: Tensor, gen: torch.Generator, iters: int, dev: str
) -> list[dict[str, object]]:
    from mega_moe._wgrad_triton import TUNING, grouped_wgrad_accumulate_kernel
    from mega_moe.wgrad_accum import grouped_wgrad_accumulate
    from mega_zero_optim import accumulate_grad

    cuda = dev == "cuda"
    total, experts = int(ends[-1]), ends.numel()
    dy = (torch.randn(total, n, generator=gen) * 0.1).to(torch.bfloat16).to(dev)
    x = torch.randn(total, k, generator=gen).to(torch.bfloat16).to(dev)
    main_grad = torch.zeros(experts, n, k, device=dev)
    exact = torch.zeros(experts, n, k, dtype=torch.float64)
    begin = 0
    for e, end in enumerate(ends.tolist()):
        exact[e] = dy[begin:end].double().t().cpu() @ x[begin:end].double().cpu()
        begin = end
    top = float(exact.abs().max())
    grouped = cuda and hasattr(torch, "_grouped_mm")

    def gemm() -> Tensor:
        if grouped:
            return torch._grouped_mm(dy.t(), x, offs=ends)
        parts, begin = [], 0
        for end in ends.tolist():
            parts.append(dy[begin:end].t() @ x[begin:end])
            begin = end
        return torch.stack(parts)

    def unfused() -> None:
        accumulate_grad(main_grad, gemm(), first=False)

    def fused() -> None:
        grouped_wgrad_accumulate(main_grad, dy, x, ends, 1.0, use_grouped_mm=grouped)

    errors = {}
    for label, fn in (("grouped_mm + accumulate", unfused), ("fused (default blocks)", fused)):
        main_grad.zero_()
        fn()
        errors[label] = float((main_grad.double().cpu() - exact).abs().max()) / top
    lines: list[tuple[str, Callable[[], object]]] = [
        ("grouped_mm (no accumulation)", gemm), ("grouped_mm + accumulate", unfused),
        ("fused (default blocks)", fused),
    ]  # fmt: skip
    configs: dict[str, tuple[int, int, int, int, int, bool]] = {}
    for blocks in TUNING if cuda else []:
        configs[f"fused {blocks}"] = blocks
        lines.append(
            (f"fused {blocks}",
             lambda b=blocks: grouped_wgrad_accumulate_kernel(main_grad, dy, x, ends, 1.0, b))
        )  # fmt: skip
    rows: list[dict[str, object]] = []
    flops = 2.0 * total * n * k
    for label, fn in lines:
        ms = _time(fn, iters) if cuda else float("nan")
        error = errors.get(label)
        row = {
            "gemm": name, "line": label, "ms": round(ms, 4),
            "tflops": round(flops / ms / 1e9, 1) if cuda else None,
            "error": None if error is None else float(f"{error:.3g}"),
            "blocks": list(configs[label]) if label in configs else None,
        }  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4 * 2048 * 6)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if args.smoke or not cuda:
        args.rows, args.experts, args.hidden, args.ffn, args.iters = 96, 4, 64, 32, 1
    dev = "cuda" if cuda else "cpu"
    gen = torch.Generator().manual_seed(0)
    counts = _counts(args.rows, args.experts, gen)
    ends = torch.cumsum(counts, 0).to(torch.int32).to(dev)
    shapes = {"fc1": (2 * args.ffn, args.hidden), "fc2": (args.hidden, args.ffn)}
    rows: list[dict[str, object]] = []
    for name, (n, k) in shapes.items():
        rows += _measure(name, n, k, ends, gen, args.iters, dev)
    out = Path(os.environ.get("OUT", "/tmp/bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "expert_wgrad.json").write_text(json.dumps(rows, indent=1))
    print("\n| gemm | line | ms | TFLOP/s | error (of max) |\n|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['gemm']} | {r['line']} | {r['ms']} | {r['tflops']} | {r['error']} |")


if __name__ == "__main__":
    main()
