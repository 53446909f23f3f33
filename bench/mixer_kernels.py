"""The Mamba mixer's causal conv + SiLU and gated RMSNorm alone at hybrid-1b's mixer shape,
forward and forward + backward: mega's Triton kernels (``mega_models.mixer_triton``) beside
the torch composition the mixer uses otherwise, eager and compiled, with peak memory and the
kernels' error against that composition in fp32.

On the GPU machine, from the repository root (one GPU; the table prints last):

    export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
    python3 bench/mixer_kernels.py                 # or: python3 bench/run.py mixer

Here (CPU, the Triton interpreter, a tiny shape; only checks that the script runs):

    uv run python bench/mixer_kernels.py --smoke

Shape (``hybrid-1b``, one tp rank: b 4, l 2048, 8 groups, each 8 heads of 64 and state 128):
in_proj's output ``[l, b, 8, 1288]`` in bf16, the conv over each group's ``x, B, C`` slice
(768 channels, width 4, bias), the norm over 8 groups of 512 with ``z`` each group's first
slice; every variant takes those slices from the same in_proj output, as the mixer does, so
its backward includes the slices' scatter into the in_proj gradient. The output gradient is
contiguous, as the mixer's upstream gives it (until 2026-12-02 it had the torch conv's
channels-major strides, which the Triton op copied first). Timing and peak memory:
``bench/ssd_kernels.py``'s (CUDA events, median of ``--iters`` after ``--warmup``; peak
allocated during one forward + backward beyond what was allocated before). With $OUT set,
the rows are also written to $OUT/mixer_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

Fn = Callable[..., Tensor]


def conv_torch(width: int, state: int) -> Fn:
    """The mixer's torch path: ``[s, b, ch] -> [b, ch, s]``, left pad, conv1d, SiLU, back."""

    def conv(zxbcdt: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        xbc = zxbcdt[..., width : 2 * width + 2 * state]
        s, b = xbc.shape[:2]
        seq_last = xbc.reshape(s, b, -1).permute(1, 2, 0)
        padded = F.pad(seq_last, (weight.shape[1] - 1, 0))
        out = F.conv1d(padded, weight.unsqueeze(1), bias, groups=weight.shape[0])
        return F.silu(out).permute(2, 0, 1).view(xbc.shape)

    return conv


def conv_triton(width: int, state: int) -> Fn:
    from mega_models.mixer_triton import causal_conv1d_silu

    def conv(zxbcdt: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        return causal_conv1d_silu(zxbcdt[..., width : 2 * width + 2 * state], weight, bias)

    return conv


def _best_configs() -> dict[str, str]:
    """The autotuner's choice per conv kernel that ran (block sizes, warps)."""
    from mega_models.mixer_triton import _conv_kernels, _norm_kernels

    kernels = {n: getattr(_conv_kernels, n) for n in ("conv_fwd", "conv_bwd_dpre",
                                                       "conv_bwd_dx")}  # fmt: skip
    kernels |= {n: getattr(_norm_kernels, n) for n in dir(_norm_kernels) if n.startswith("norm_")}
    return {n: str(getattr(k, "best_config", None)) for n, k in kernels.items()}


def norm_torch(width: int, eps: float) -> Fn:
    def norm(y: Tensor, zxbcdt: Tensor, weight: Tensor) -> Tensor:
        z = zxbcdt[..., :width]
        g = y.shape[-2]
        return F.rms_norm(y * F.silu(z), (width,), eps=eps) * weight.view(g, width)

    return norm


def norm_triton(width: int, eps: float) -> Fn:
    from mega_models.mixer_triton import gated_rms_norm

    def norm(y: Tensor, zxbcdt: Tensor, weight: Tensor) -> Tensor:
        return gated_rms_norm(y, zxbcdt[..., :width], weight, eps)

    return norm


def _inputs(args: argparse.Namespace, dev: str, dtype: torch.dtype) -> dict[str, list[Tensor]]:
    gen = torch.Generator(device=dev).manual_seed(0)
    g, w, n = args.groups, args.heads * args.head_dim, args.state
    per_group = 2 * w + 2 * n + args.heads
    zxbcdt = torch.randn(args.seq, args.batch, g, per_group, device=dev, dtype=dtype, generator=gen)
    ch = g * (w + 2 * n)
    bound = 1.0 / args.width**0.5
    conv_w = (torch.rand(ch, args.width, device=dev, generator=gen) * 2 - 1) * bound
    conv_b = (torch.rand(ch, device=dev, generator=gen) * 2 - 1) * bound
    y = torch.randn(args.seq, args.batch, g, w, device=dev, dtype=dtype, generator=gen)
    norm_w = 1.0 + 0.1 * torch.randn(g * w, device=dev, generator=gen)
    return {
        "conv": [zxbcdt, conv_w.to(dtype), conv_b.to(dtype)],
        "norm": [y, zxbcdt, norm_w.to(dtype)],
    }


def _errors(ref_fn: Fn, fn: Fn, inputs: list[Tensor]) -> dict[str, float]:
    """Max |error| of ``fn`` on ``inputs`` against ``ref_fn`` on their fp32 copies, output
    and each input's gradient, relative to the reference's largest magnitude."""
    ref_in = [t.detach().float().requires_grad_() for t in inputs]
    mine_in = [t.detach().clone().requires_grad_() for t in inputs]
    ref, out = ref_fn(*ref_in), fn(*mine_in)
    dy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(ref.device)
    ref_grads = torch.autograd.grad(ref, ref_in, dy)
    grads = torch.autograd.grad(out, mine_in, dy.to(out.dtype))
    rows = {"out": (out, ref)} | {
        f"d{i}": pair for i, pair in enumerate(zip(grads, ref_grads, strict=True))
    }
    return {
        name: float(
            (a.detach().float() - r.detach()).abs().max() / r.detach().abs().max().clamp_min(1e-30)
        )
        for name, (a, r) in rows.items()
    }


def _conv_backward_parts(
    args: argparse.Namespace, zxbcdt: Tensor, weight: Tensor, bias: Tensor, dy: Tensor
) -> dict[str, float]:
    """Where the Triton conv's forward + backward time goes at this shape (ms, medians): the
    backward op alone (contiguous dy), the contiguous copy of a channels-major ``dy`` (the
    torch conv's output layout, which the timings before 2026-12-02 gave every variant),
    the slice's scatter into a zero in_proj gradient, and that gradient's accumulation into
    the leaf's .grad (what autograd adds around the op in ``measure``)."""
    from ssd_kernels import _median_ms

    from mega_models.mixer_triton._conv import conv_silu_backward

    w, n = args.heads * args.head_dim, args.state
    x = zxbcdt[..., w : 2 * w + 2 * n]
    dense = dy.contiguous()
    dx = conv_silu_backward(dense, x, weight, bias)[0]
    full = torch.zeros_like(zxbcdt)

    def scatter() -> None:
        g = torch.zeros_like(zxbcdt)
        g[..., w : 2 * w + 2 * n].copy_(dx)

    parts = {
        "backward op, contiguous dy": lambda: conv_silu_backward(dense, x, weight, bias),
        "dy.contiguous() of a channels-major dy": lambda: dy.contiguous(),
        "slice scatter into in_proj's gradient": scatter,
        "leaf .grad accumulation": lambda: full.add_(zxbcdt),
    }
    return {name: _median_ms(fn, args.warmup, args.iters) for name, fn in parts.items()}


def _smoke(args: argparse.Namespace) -> int:
    """CPU, interpreter: each variant once forward + backward, errors against fp32 torch."""
    dtype = torch.float32
    inputs = _inputs(args, "cpu", dtype)
    w, n = args.heads * args.head_dim, args.state
    ops = {
        "conv": (conv_torch(w, n), conv_triton(w, n)),
        "norm": (norm_torch(w, 1e-5), norm_triton(w, 1e-5)),
    }
    for name, (ref_fn, fn) in ops.items():
        start = time.perf_counter()
        errs = _errors(ref_fn, fn, inputs[name])
        worst = max(errs.values())
        print(f"{name}: triton vs torch fp32, worst relative error {worst:.2e} "
              f"({time.perf_counter() - start:.1f} s)")  # fmt: skip
        if worst > 1e-5:
            print(f"{name}: error too large: {errs}", file=sys.stderr)
            return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8, help="Mamba heads per group")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--state", type=int, default=128)
    ap.add_argument("--width", type=int, default=4, help="conv kernel size")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shape")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        args.batch, args.seq, args.groups, args.heads, args.head_dim, args.state = 2, 37, 2, 2, 4, 4
        return _smoke(args)
    if not torch.cuda.is_available():
        print("mixer_kernels.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ssd_kernels import measure

    inputs = _inputs(args, "cuda", torch.bfloat16)
    w, n, eps = args.heads * args.head_dim, args.state, 1e-5
    variants = {
        "conv": {"triton": conv_triton(w, n),
                 "torch eager": conv_torch(w, n),
                 "torch compiled": torch.compile(conv_torch(w, n))},
        "norm": {"triton": norm_triton(w, eps), "torch eager": norm_torch(w, eps),
                 "torch compiled": torch.compile(norm_torch(w, eps))},
    }  # fmt: skip
    rows: dict[str, dict[str, float] | str] = {}
    for op, fns in variants.items():
        with torch.no_grad():
            # contiguous, as the mixer's upstream gives it (the SSD's gradients of x, B, C
            # concatenated); the torch conv's own output is channels-major instead
            dy = torch.randn(
                fns["torch eager"](*inputs[op]).shape, device="cuda", dtype=torch.bfloat16
            )
        for name, fn in fns.items():
            label = f"{op} {name}"
            try:
                rows[label] = measure(fn, inputs[op], dy, args.warmup, args.iters)
            except Exception as err:  # one failing line does not stop the table
                rows[label] = f"failed: {type(err).__name__}: {str(err)[:300]}"
            print(f"{label}: {rows[label]}", flush=True)
    errs: dict[str, dict[str, float] | str] = {}
    for op, ref_fn, fn in (("conv", conv_torch(w, n), conv_triton(w, n)),
                           ("norm", norm_torch(w, eps), norm_triton(w, eps))):  # fmt: skip
        try:
            errs[op] = _errors(ref_fn, fn, inputs[op])
        except Exception as err:
            errs[op] = f"failed: {type(err).__name__}: {str(err)[:300]}"

    try:
        conv_dy = torch.randn_like(variants["conv"]["torch eager"](*inputs["conv"]))
        print(f"channels-major dy (the torch conv's output layout): strides {conv_dy.stride()}")
        for name, ms in _conv_backward_parts(args, *inputs["conv"], conv_dy).items():
            print(f"conv triton part: {name}: {ms:.3f} ms")
    except Exception as err:
        print(f"conv triton parts failed: {type(err).__name__}: {str(err)[:300]}")
    print("autotuned:", _best_configs())
    print(f"\nMamba mixer conv + SiLU and gated norm, b {args.batch} l {args.seq} groups "
          f"{args.groups} x {w} (+ 2 x {n} conv), bf16, {torch.cuda.get_device_name()}")  # fmt: skip
    print(f"| {'op':<22} | fwd ms | fwd+bwd ms | vs eager | peak GiB |")
    print(f"|{'-' * 24}|-------:|-----------:|---------:|---------:|")
    for label, row in rows.items():
        if isinstance(row, str):
            print(f"| {label:<22} | {row} |")
            continue
        eager = rows.get(f"{label.split()[0]} torch eager")
        ratio = (
            f"{eager['fwd_bwd_ms'] / row['fwd_bwd_ms']:.2f}x" if isinstance(eager, dict) else "-"
        )
        print(f"| {label:<22} | {row['fwd_ms']:6.3f} | {row['fwd_bwd_ms']:10.3f} | {ratio:>8} "
              f"| {row['peak_gib']:8.3f} |")  # fmt: skip
    print("\ntriton (bf16) against the torch composition in fp32: max |error| / max |reference|")
    for op, err in errs.items():
        print(
            f"  {op}: {err if isinstance(err, str) else ', '.join(f'{k} {v:.2e}' for k, v in err.items())}"
        )
    out = os.environ.get("OUT")
    if out:
        record = {"rows": rows, "errors": errs, "args": vars(args)}
        Path(out, "mixer_kernels.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
