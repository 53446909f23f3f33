"""FP8 scaling recipes side by side: tensor-wise, row-wise and DeepSeek-style block-wise.

    python3 bench/fp8_recipes.py --smoke          # CPU, small shapes, emulated fp8 (~1 min)
    python3 bench/fp8_recipes.py                  # K 2048, N 5632, M 4096; CPU or one GPU

Numerics, two parts. (1) One Llama-like linear (``y = x W^T``, K in, N out, M tokens) with
inputs that carry outliers: N(0, 1) activations with 6 channels 20-100x larger (as LLM
activations have) and, in a second input set, tokens spread over 2^8 in magnitude too; the
output gradient N(0, 1e-3) per token spread over 2^4. For each recipe the relative error
``||fp8 - fp32|| / ||fp32||`` of the forward, dgrad and wgrad GEMM against fp32 matmuls of
the same inputs. (2) The trainer's tiny GPT trained N AdamW steps (lr 3e-3) from one seed on
one fixed random batch (seq 64, 2 sequences): fp32, bf16, and bf16 with each fp8 recipe; the last loss and its relative
difference from fp32's. On a GPU of compute capability 8.9+ the GEMMs run ``torch._scaled_mm``
(row) / ``F.scaled_mm`` block-wise where torch has it (``--time`` also times each recipe's
forward + backward); elsewhere the exact emulation. Prints one table per part and writes
$OUT/fp8_recipes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import Tensor

from mega_parallel_grid import init_process_groups
from mega_pretrain.build import build, gpt_config, parallel_config, param_dtype
from mega_pretrain.config import load_config
from mega_pretrain.runtime import collective_timeout, start_distributed
from mega_pretrain.step import StepRunner
from mega_tp_layers import (
    Fp8Recipe,
    fp8_linear,
    fp8_linear_dgrad,
    fp8_linear_forward,
    fp8_linear_wgrad,
)

RECIPES = ("tensor", "row", "block")
OUTLIER_GAINS = (20.0, 35.0, 50.0, 65.0, 80.0, 100.0)


def linear_inputs(
    m: int, k: int, n: int, token_spread: bool, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    channels = torch.randperm(k, generator=g)[: len(OUTLIER_GAINS)]
    x[:, channels] *= torch.tensor(OUTLIER_GAINS)
    if token_spread:
        x *= torch.exp2(torch.empty(m, 1).uniform_(-6, 2, generator=g))
    w = 0.02 * torch.randn(n, k, generator=g)
    dy = (
        1e-3
        * torch.randn(m, n, generator=g)
        * torch.exp2(torch.empty(m, 1).uniform_(-4, 0, generator=g))
    )
    return x.to(device), w.to(device), dy.to(device)


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b).norm() / b.norm())


def gemm_errors(x: Tensor, w: Tensor, dy: Tensor) -> dict[str, dict[str, float]]:
    ref = {"forward": x @ w.t(), "dgrad": dy @ w, "wgrad": dy.t() @ x}
    out: dict[str, dict[str, float]] = {}
    for scaling in RECIPES:
        r = Fp8Recipe(scaling=scaling)  # type: ignore[arg-type]
        out[scaling] = {
            "forward": _rel(fp8_linear_forward(x, w, r, out_dtype=torch.float32), ref["forward"]),
            "dgrad": _rel(fp8_linear_dgrad(dy, w, r, out_dtype=torch.float32), ref["dgrad"]),
            "wgrad": _rel(fp8_linear_wgrad(dy, x, r, out_dtype=torch.float32), ref["wgrad"]),
        }
    return out


def time_recipes(x: Tensor, w: Tensor, dy: Tensor, iters: int) -> dict[str, float]:
    """Median ms of one bf16-in fp8 forward + backward per recipe (CUDA events on a GPU)."""
    out = {}
    xb, wb, gb = (t.bfloat16() for t in (x, w, dy))
    for scaling in RECIPES:
        r = Fp8Recipe(scaling=scaling)  # type: ignore[arg-type]
        xl, wl = xb.clone().requires_grad_(), wb.clone().requires_grad_()
        times = []
        for i in range(iters + 3):
            xl.grad = wl.grad = None
            t0 = time.perf_counter()
            fp8_linear(xl, wl, recipe=r).backward(gb)
            if x.is_cuda:
                torch.cuda.synchronize()
            if i >= 3:
                times.append(1e3 * (time.perf_counter() - t0))
        out[scaling] = statistics.median(times)
    return out


def train_losses(run: str, steps: int, seq: int, mb: int, device: torch.device) -> list[float]:
    precision = "fp32" if run == "fp32" else "bf16"
    overrides = [("model.size", "tiny"), ("train.seq_len", str(seq)),
                 ("train.micro_batch_size", str(mb)), ("train.global_batch_size", str(mb)),
                 ("train.precision", precision)]  # fmt: skip
    if run.startswith("fp8-"):
        overrides += [("train.fp8", "true"), ("train.fp8_recipe", run[4:])]
    config = load_config(None, overrides)
    model = gpt_config(config)
    groups = init_process_groups(parallel_config(config))
    built = build(config, groups, device)
    runner = StepRunner(built, groups, seq_len=seq, micro_batch_size=mb,
                        hidden_size=model.hidden_size, dtype=param_dtype(config, device),
                        device=device, sequence_parallel=False)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (mb, seq + 1), generator=gen).to(device)
    batch = [(tokens[:, :-1], tokens[:, 1:])]  # one batch, learnt by heart: the loss falls
    return [float(runner.train_step(batch, 3e-3)[0]) for _ in range(steps)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--time", action="store_true", help="also time each recipe (GPU)")
    ap.add_argument("--smoke", action="store_true", help="small shapes, 10 steps")
    a = ap.parse_args()
    if a.smoke:
        a.tokens, a.hidden, a.ffn, a.steps = 512, 256, 704, 10
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    start_distributed(device, collective_timeout(10))
    result: dict[str, object] = {"shape": [a.tokens, a.hidden, a.ffn], "torch": torch.__version__,
                                 "device": torch.cuda.get_device_name(0) if cuda else "cpu"}  # fmt: skip
    print(f"linear M {a.tokens}, K {a.hidden}, N {a.ffn}: ||fp8 - fp32|| / ||fp32||")
    print(f"{'inputs':22} {'recipe':7} {'forward':>8} {'dgrad':>8} {'wgrad':>8}")
    for label, spread in (("channel outliers", False), ("+ token spread 2^8", True)):
        x, w, dy = linear_inputs(a.tokens, a.hidden, a.ffn, spread, device)
        errors = gemm_errors(x, w, dy)
        result[f"gemm {label}"] = errors
        for scaling, e in errors.items():
            print(f"{label:22} {scaling:7} {e['forward']:8.4f} {e['dgrad']:8.4f} {e['wgrad']:8.4f}")
        if a.time and not spread:
            result["ms"] = ms = time_recipes(x, w, dy, 20)
            print("fp8 forward + backward ms: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items()))
    runs = ("fp32", "bf16", *(f"fp8-{s}" for s in RECIPES))
    losses = {run: train_losses(run, a.steps, 64, 2, device) for run in runs}
    result["losses"] = losses
    ref = losses["fp32"][-1]
    print(f"tiny GPT, {a.steps} steps, seq 64, mb 2: first and last loss, last vs fp32")
    for run, ls in losses.items():
        print(f"{run:11} {ls[0]:.5f} {ls[-1]:.5f} {abs(ls[-1] - ref) / ref:9.2e}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "fp8_recipes.json"), "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
