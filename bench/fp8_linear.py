"""bf16 vs FP8 (``torch._scaled_mm``) linear layer, forward + backward, on one GPU.

    python3 bench/fp8_linear.py                        # H200: h 2048, ffn 5632, 16k tokens
    python3 bench/fp8_linear.py --smoke                # CPU, tiny shapes, emulated fp8
    python3 bench/fp8_linear.py --recipe block         # row | block scaling (default tensor)

Times ``F.linear`` in bf16 against ``mega_tp_layers.fp8_linear`` (forward, dgrad and wgrad
in fp8, dynamic scales of ``--recipe``: tensor-wise, row-wise or 1x128/128x128 block-wise)
for the MLP's two GEMM shapes (h -> ffn, ffn -> h):
10 warm-up iterations, then 50 timed with CUDA events, median reported. Before timing it
checks the ``_scaled_mm`` results against the exact CPU-style emulation on the same device
(same fp8 values and scales, fp32 matmul): they differ only by the accumulation order,
and the rounding of the bf16 output, so the check is a relative error (max |diff| / max |ref|)
below 2^-7, one bf16 ulp (measured on H200: 0.0034-0.0063). Appends one JSON line
per shape to $OUT/results.jsonl and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from mega_tp_layers import (
    Fp8Recipe,
    fp8_gemm_supported,
    fp8_linear,
    fp8_linear_dgrad,
    fp8_linear_forward,
    fp8_linear_wgrad,
)


def _time(fn: Callable[[], None], warmup: int, iters: int, cuda: bool) -> float:
    """Median milliseconds of ``fn``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _step(
    linear: Callable[[Tensor, Tensor], Tensor], x: Tensor, w: Tensor, g: Tensor
) -> Callable[[], None]:
    """One forward + backward of ``linear`` on fresh gradient slots (no accumulation)."""
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()

    def step() -> None:
        xl.grad = wl.grad = None
        linear(xl, wl).backward(g)

    return step


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def _check_against_emulation(
    x: Tensor, w: Tensor, g: Tensor, recipe: Fp8Recipe
) -> dict[str, float]:
    """Max relative difference of each fp8 GEMM from its emulation (same values, same scales)."""
    emulated = Fp8Recipe(emulate=True, scaling=recipe.scaling)
    x2d, g2d = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    return {
        "forward": _rel(fp8_linear_forward(x2d, w, recipe), fp8_linear_forward(x2d, w, emulated)),
        "dgrad": _rel(fp8_linear_dgrad(g2d, w, recipe), fp8_linear_dgrad(g2d, w, emulated)),
        "wgrad": _rel(fp8_linear_wgrad(g2d, x2d, recipe), fp8_linear_wgrad(g2d, x2d, emulated)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="torch.compile both variants")
    ap.add_argument("--smoke", action="store_true", help="CPU-sized shapes, a few iterations")
    ap.add_argument("--recipe", choices=("tensor", "row", "block"), default="tensor")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.ffn, args.tokens, args.iters, args.warmup = 64, 176, 256, 3, 1
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    recipe = Fp8Recipe(scaling=args.recipe)
    emulated = recipe.emulated_on(device)
    if not args.smoke and not fp8_gemm_supported(device):
        raise SystemExit("this benchmark needs a CUDA GPU of compute capability 8.9+ (or --smoke)")
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    for d_in, d_out in ((args.hidden, args.ffn), (args.ffn, args.hidden)):
        x = torch.randn(args.tokens, d_in, device=device, dtype=dtype, generator=gen)
        w = 0.02 * torch.randn(d_out, d_in, device=device, dtype=dtype, generator=gen)
        g = torch.randn(args.tokens, d_out, device=device, dtype=dtype, generator=gen)
        check = _check_against_emulation(x, w, g, recipe)
        print(f"_scaled_mm vs emulation (max |diff| / max |ref|): {check}", flush=True)
        if max(check.values()) > 2.0**-7:  # one bf16 ulp of the output, relative to its max
            raise SystemExit(f"_scaled_mm disagrees with the emulation: {check}")
        steps = {
            "bf16": _step(F.linear, x, w, g),
            "fp8": _step(lambda a, b: fp8_linear(a, b, recipe=recipe), x, w, g),
        }
        if args.compile:
            steps = {name: torch.compile(fn) for name, fn in steps.items()}
        ms = {name: _time(fn, args.warmup, args.iters, cuda) for name, fn in steps.items()}
        flops = 3 * 2 * args.tokens * d_in * d_out  # forward + dgrad + wgrad
        result = {
            "bench": "fp8_linear", "in": d_in, "out": d_out, "tokens": args.tokens,
            "bf16_ms": ms["bf16"], "fp8_ms": ms["fp8"], "speedup": ms["bf16"] / ms["fp8"],
            "bf16_tflops": flops / ms["bf16"] / 1e9, "fp8_tflops": flops / ms["fp8"] / 1e9,
            "vs_emulation_rel": check, "emulated": emulated, "compile": args.compile,
            "recipe": args.recipe,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        }  # fmt: skip
        line = json.dumps(result, sort_keys=True)
        print("RESULT " + line, flush=True)
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "results.jsonl"), "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
