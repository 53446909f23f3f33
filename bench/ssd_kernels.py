"""The SSD scan alone at hybrid-1b's mixer shape, fwd and fwd+bwd: mega's Triton kernels
(``ssd_triton``) beside ``ssd_chunked`` (eager and compiled) and mamba_ssm's Triton
``mamba_chunk_scan_combined``, plus the Triton kernels' error against ``ssd_chunked`` in fp32.

On the GPU machine, from the repository root (one GPU; the table prints last):

    export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
    python3 bench/ssd_kernels.py                 # or: python3 bench/run.py ssd

Shape (``hybrid-1b``: b 4, l 2048, 64 heads of 64, 8 groups of state 128, chunk 128), inputs
as ``anchors/ssd_anchor.py`` draws them. The mamba_ssm line needs its Triton files: the
``mamba_triton`` folder of the anchors, found at ``$SSD_ANCHOR_DIR``, ``anchors/mamba_triton``
or ``../shared/anchors/mamba_triton``; without it that line says so and the rest runs.
Timing: CUDA events, median of ``--iters`` after ``--warmup`` calls (the autotuning and
compiling happen there). Like the anchor script, mega's torch scan runs in fp32 from bf16
inputs (as the mixer calls it); the Triton kernels read bf16 and accumulate in fp32.
With $OUT set, the rows are also written to $OUT/ssd_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from mega_models.ssd import ssd_chunked
from mega_models.ssd_triton import ssd_triton

ROOT = Path(__file__).resolve().parent.parent
Scan = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def _inputs(b: int, length: int, h: int, p: int, g: int, n: int, dev: str = "cuda") -> list[Tensor]:
    """Batch-first bf16 inputs as the anchor draws them (A fp32)."""
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    x = torch.randn(b, length, h, p, device=dev, dtype=bf16)
    dt = torch.nn.functional.softplus(torch.randn(b, length, h, device=dev) - 2).to(bf16)
    A = -torch.rand(h, device=dev).add(0.5)
    B = torch.randn(b, length, g, n, device=dev, dtype=bf16) / n**0.5
    C = torch.randn(b, length, g, n, device=dev, dtype=bf16) / n**0.5
    return [x, dt, A, B, C]


def _seq_first(t: Tensor) -> Tensor:
    return t if t.dim() == 1 else t.transpose(0, 1)  # [b, l, ...] -> [l, b, ...] (a view)


def mega_triton(q: int, dtype: torch.dtype | None = None) -> Scan:
    """``ssd_triton`` on the batch-first inputs (strided views, no copies); ``dtype`` casts."""

    def scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> Tensor:
        ins = [_seq_first(t if dtype is None else t.to(dtype)) for t in (x, dt, A, B, C)]
        return ssd_triton(*ins, q).transpose(0, 1)

    return scan


def mega_torch(q: int) -> Scan:
    """``ssd_chunked`` in fp32, as the mixer and the anchor script call it."""

    def scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> Tensor:
        f = torch.float32
        ins = [_seq_first(t.to(f)) for t in (x, dt, A, B, C)]
        return ssd_chunked(*ins, q).transpose(0, 1).to(x.dtype)

    return scan


def anchor_scan(q: int) -> Scan | str:
    """mamba_ssm's ``mamba_chunk_scan_combined``, or why it is not there."""
    candidates = [os.environ.get("SSD_ANCHOR_DIR", ""), ROOT / "anchors" / "mamba_triton",
                  ROOT.parent / "shared" / "anchors" / "mamba_triton"]  # fmt: skip
    for folder in candidates:
        if folder and (Path(folder) / "mamba_ssm").is_dir():
            sys.path.insert(0, str(folder))
            break
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError as err:
        return f"not found ({err}); set SSD_ANCHOR_DIR to the anchors' mamba_triton folder"

    def scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> Tensor:
        out: Tensor = mamba_chunk_scan_combined(x, dt, A, B, C, q)
        return out

    return scan


def _median_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure(
    scan: Scan, inputs: list[Tensor], dy: Tensor, warmup: int, iters: int
) -> dict[str, float]:
    """Forward and forward+backward medians (ms) and the fwd+bwd peak memory (GiB)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]

    def fwd() -> None:
        with torch.no_grad():
            scan(*leaves)

    def fwd_bwd() -> None:
        scan(*leaves).backward(dy)

    fwd_ms = _median_ms(fwd, warmup, iters)
    both_ms = _median_ms(fwd_bwd, warmup, iters)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**30
    return {"fwd_ms": fwd_ms, "fwd_bwd_ms": both_ms, "peak_gib": peak}


def errors(inputs: list[Tensor], dy: Tensor, q: int) -> list[tuple[str, float, float]]:
    """Max-abs errors of ``ssd_triton`` (fp32 inputs and bf16 inputs) against ``ssd_chunked``
    in fp32, output and each gradient, with the reference's largest magnitude."""
    f = torch.float32
    ref_in = [_seq_first(t.detach().to(f)).requires_grad_() for t in inputs]
    ref = ssd_chunked(*ref_in, q)
    ref.backward(_seq_first(dy.to(f)))
    rows = []
    for label, dtype in (("fp32", f), ("bf16", torch.bfloat16)):
        mine_in = [_seq_first(t.detach().to(dtype if t.dim() > 1 else f)).requires_grad_()
                   for t in inputs]  # fmt: skip
        out = ssd_triton(*mine_in, q)
        out.backward(_seq_first(dy.to(dtype)))
        pairs = [("y", out, ref)] + [
            (f"d{name}", mine.grad, full.grad)
            for name, mine, full in zip(("x", "dt", "A", "B", "C"), mine_in, ref_in, strict=True)
        ]
        for name, a, r in pairs:
            assert a is not None and r is not None
            err = float((a.detach().float() - r).abs().max())
            rows.append((f"{label} {name}", err, float(r.abs().max())))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--state", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("ssd_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    q = args.chunk
    shape = (args.batch, args.seq, args.heads, args.head_dim, args.groups, args.state)
    inputs = _inputs(*shape)
    dy = torch.randn_like(inputs[0])
    anchor = anchor_scan(q)
    scans: dict[str, Scan | str] = {
        "mamba_ssm triton (bf16)": anchor,
        "mega ssd_triton (bf16)": mega_triton(q),
        "mega ssd_triton (fp32 in)": mega_triton(q, torch.float32),
        "mega ssd_chunked eager": mega_torch(q),
        "mega ssd_chunked compiled": torch.compile(mega_torch(q)),
    }
    rows: dict[str, dict[str, float] | str] = {}
    for name, scan in scans.items():
        if isinstance(scan, str):
            rows[name] = scan
            continue
        try:
            rows[name] = measure(scan, inputs, dy, args.warmup, args.iters)
        except Exception as err:  # one failing line does not stop the table
            rows[name] = f"failed: {type(err).__name__}: {str(err)[:300]}"
        print(f"{name}: {rows[name]}", flush=True)
    try:
        errs = errors(inputs, dy, q)
    except Exception as err:
        errs = [(f"failed: {type(err).__name__}: {str(err)[:300]}", float("nan"), float("nan"))]

    ref = rows.get("mamba_ssm triton (bf16)")
    base = ref["fwd_bwd_ms"] if isinstance(ref, dict) else None
    print(f"\nSSD scan, b {args.batch} l {args.seq} heads {args.heads}x{args.head_dim} "
          f"groups {args.groups} state {args.state} chunk {q}, {torch.cuda.get_device_name()}")  # fmt: skip
    print(f"| {'scan':<28} | fwd ms | fwd+bwd ms | vs mamba_ssm | peak GiB |")
    print(f"|{'-' * 30}|-------:|-----------:|-------------:|---------:|")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"| {name:<28} | {row} |")
            continue
        ratio = f"{row['fwd_bwd_ms'] / base:.2f}x" if base else "-"
        print(f"| {name:<28} | {row['fwd_ms']:6.3f} | {row['fwd_bwd_ms']:10.3f} | {ratio:>12} "
              f"| {row['peak_gib']:8.2f} |")  # fmt: skip
    print("\nssd_triton against ssd_chunked (fp32): max |error|, reference max |value|")
    for name, err, scale in errs:
        print(
            f"  {name:<9} {err:10.3e}  (ref max {scale:.3e}, relative {err / max(scale, 1e-30):.2e})"
        )
    out = os.environ.get("OUT")
    if out:
        record = {"rows": rows, "errors": errs, "shape": shape, "chunk": q}
        Path(out, "ssd_kernels.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
