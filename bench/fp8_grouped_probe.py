"""What an FP8 expert FFN could gain: ``torch._scaled_grouped_mm`` against bf16 ``_grouped_mm``.

Issue 22's target 3 names "the expert FFN in FP8 as an option". Before building it, this
measures at the MoE sizes' expert shapes (one micro-batch of mb x seq tokens, top-k copies,
dropless: every expert's row count arbitrary) the three grouped GEMMs of each expert linear:

- forward ``x [M, K] @ w[e].T`` (2d x 3d, groups along M),
- dgrad ``dy [M, N] @ w[e]`` (2d x 3d),
- wgrad ``dy_e^T @ x_e`` (2d x 2d, groups along the contracted tokens),

each in bf16 and in fp8 (e4m3, row-wise scales: one per token row, one per expert output
channel; the wgrad's per expert and row of each operand), the GEMM alone and with its
quantisation, and with row counts as the router gives them and padded to multiples of 16
(whether the fp8 kernels take unaligned groups is one of the questions). Each fp8 result is
checked against the same fp8 values multiplied in fp32 (the emulation a CPU test would use):
the relative error must be that of fp32 accumulation (fast accumulation forward: ~1e-3).

GPU (sm90+) only for the timings; ``--smoke`` runs the emulation alone at a tiny shape on CPU.
Prints one table; writes ``$OUT/fp8_grouped_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
FMAX = torch.finfo(E4M3).max

#: torch._scaled_grouped_mm's groups must be multiples of 16 bytes along the grouped dim
#: (an H100 with torch 2.11, 2026-12-06: a device-side assert "expected input tensor dynamic
#: dimension byte size to be non-negative multiple of 16" for router-given row counts, which
#: leaves the CUDA context unusable; so the probe does not call it for those). bf16's
#: ``_grouped_mm`` asserts the same for a row-major ``[n, tokens]`` wgrad operand (2 bytes a
#: row); mega_moe passes ``dy.t()``, whose tokens are the outer stride, and so does the probe.
FP8_GROUP_ALIGN = 16

# (name, hidden, expert ffn, experts, top-k): the registry's MoE sizes (SwiGLU: fc1 is 2 x ffn)
SIZES = [("moe-2b", 2048, 1408, 16, 2), ("deepseek-3b", 2048, 704, 64, 6)]


def _counts(tokens: int, experts: int, align: int, gen: torch.Generator) -> list[int]:
    """Dropless row counts summing to ``tokens``: balanced +-25 %, each a multiple of ``align``
    (1: as the router gives them; padded totals grow by the padding)."""
    share = torch.rand(experts, generator=gen) * 0.5 + 0.75
    raw = (share / share.sum() * tokens).floor().long()
    raw[-1] += tokens - int(raw.sum())
    return [(-(-int(c) // align)) * align for c in raw]


def _rowwise(t: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """fp8 values and fp32 inverse scales, one scale per slice along ``dim`` reduced away."""
    amax = t.float().abs().amax(dim=dim, keepdim=True).clamp(min=1e-12)
    scale = FMAX / amax
    return (t.float() * scale).clamp(-FMAX, FMAX).to(E4M3), scale.reciprocal().squeeze(dim)


def _groups(counts: list[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds


def _emulated_2d3d(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor, counts: list[int]) -> Tensor:
    """``out[rows of e] = (a_e @ b[e]) * sa_e[:, None] * sb[e][None, :]`` in fp32."""
    outs = []
    for e, (lo, hi) in enumerate(_groups(counts)):
        outs.append((a[lo:hi].float() @ b[e].float()) * sa[lo:hi, None] * sb[e][None, :])
    return torch.cat(outs)


def _emulated_2d2d(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor, counts: list[int]) -> Tensor:
    """``out[e] = (a[:, cols of e] @ b[rows of e]) * sa[e] * sb[e]``; a [m, T], b [T, n]."""
    m, n = a.shape[0], b.shape[1]
    outs = []
    for e, (lo, hi) in enumerate(_groups(counts)):
        prod = a[:, lo:hi].float() @ b[lo:hi].float()
        outs.append(prod * sa[e * m : (e + 1) * m, None] * sb[e * n : (e + 1) * n][None, :])
    return torch.stack(outs)


def _time(fn: Callable[[], object], reps: int) -> float:
    """Median ms of ``fn`` on the GPU (CUDA events), after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def _rel(got: Tensor, want: Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


def _probe(
    m_rows: list[int], k: int, n: int, device: torch.device, reps: int, gpu: bool,
    fast_backward: bool = False,
) -> dict[str, object]:  # fmt: skip
    """The three GEMMs of one expert linear (``[E, n, k]`` weight) over row counts ``m_rows``."""
    experts, total = len(m_rows), sum(m_rows)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(total, k, device=device, generator=gen).bfloat16()
    w = (torch.randn(experts, n, k, device=device, generator=gen) * 0.02).bfloat16()
    dy = (torch.randn(total, n, device=device, generator=gen) * 1e-3).bfloat16()
    offs = torch.tensor(list(_cumsum(m_rows)), dtype=torch.int32, device=device)
    row: dict[str, object] = {"rows": total, "k": k, "n": n, "experts": experts}
    flops = 2.0 * total * k * n

    # fp8 operands, each in the layout its GEMM wants (a row-major, b column-major)
    xq, sx = _rowwise(x, 1)  # [M, k], [M]
    wq, sw = _rowwise(w, 2)  # [E, n, k] (row-major: .transpose(1, 2) is column-major), [E, n]
    dyq, sdy = _rowwise(dy, 1)  # [M, n], [M]
    wtq, swt = _rowwise(w.transpose(1, 2).contiguous(), 2)  # [E, k, n], [E, k]: dgrad's b
    dyt = dy.t().contiguous()  # [n, M]: wgrad's a, scaled per (expert block, row)
    xt = x.t().contiguous()  # [k, M]: wgrad's b (column-major as .t()), per (block, row)
    dytq, sdyt = _blockwise_rows(dyt, m_rows)  # [n, M], [E * n]
    xtq, sxt = _blockwise_rows(xt, m_rows)  # [k, M], [E * k]

    gemms: dict[str, tuple[Callable[[], Tensor], Callable[[], Tensor], Callable[[], Tensor]]] = {
        "fwd": (
            lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs),
            lambda: torch._scaled_grouped_mm(
                xq, wq.transpose(1, 2), sx, sw, offs=offs, out_dtype=torch.bfloat16,
                use_fast_accum=True,
            ),
            lambda: _emulated_2d3d(xq, sx, wq.transpose(1, 2), sw, m_rows),
        ),
        "dgrad": (
            lambda: torch._grouped_mm(dy, w, offs=offs),
            lambda: torch._scaled_grouped_mm(
                dyq, wtq.transpose(1, 2), sdy, swt, offs=offs, out_dtype=torch.bfloat16,
                use_fast_accum=fast_backward,
            ),
            lambda: _emulated_2d3d(dyq, sdy, wtq.transpose(1, 2), swt, m_rows),
        ),
        "wgrad": (
            lambda: torch._grouped_mm(dy.t(), x, offs=offs),  # as mega_moe runs it
            lambda: torch._scaled_grouped_mm(
                dytq, xtq.t(), sdyt, sxt, offs=offs, out_dtype=torch.bfloat16,
                use_fast_accum=fast_backward,
            ),
            lambda: _emulated_2d2d(dytq, sdyt, xtq.t(), sxt, m_rows),
        ),
    }  # fmt: skip
    quantise = {
        "fwd": lambda: (_rowwise(x, 1), _rowwise(w, 2)),
        "dgrad": lambda: (_rowwise(dy, 1), _rowwise(w.transpose(1, 2).contiguous(), 2)),
        "wgrad": lambda: (
            _blockwise_rows(dy.t().contiguous(), m_rows),
            _blockwise_rows(x.t().contiguous(), m_rows),
        ),
    }
    for name, (bf16, fp8, emulated) in gemms.items():
        want = emulated()
        if not gpu:  # the layouts and scales right: fp8's error against bf16 is a few %
            row[f"{name}_emulated_vs_bf16"] = _rel(want, bf16().float())
            continue
        if any(c % FP8_GROUP_ALIGN for c in m_rows):  # a device-side assert: no calling it
            row[f"{name}_fp8_error"] = f"rows per group not multiples of {FP8_GROUP_ALIGN}"
            row[f"{name}_bf16_ms"] = _time(bf16, reps)
            continue
        got = fp8()
        row[f"{name}_rel_err"] = _rel(got, want)
        row[f"{name}_bf16_vs_fp8_rel"] = _rel(got, bf16())
        b_ms, f_ms, q_ms = _time(bf16, reps), _time(fp8, reps), _time(quantise[name], reps)
        row.update({
            f"{name}_bf16_ms": b_ms, f"{name}_fp8_ms": f_ms, f"{name}_quant_ms": q_ms,
            f"{name}_bf16_tflops": flops / b_ms / 1e9, f"{name}_fp8_tflops": flops / f_ms / 1e9,
        })  # fmt: skip
    return row


def _blockwise_rows(t: Tensor, counts: list[int]) -> tuple[Tensor, Tensor]:
    """``t [r, M]`` with one scale per (expert block of columns, row): fp8 and ``[E * r]``."""
    data, scales = [], []
    for lo, hi in _groups(counts):
        q, s = _rowwise(t[:, lo:hi], 1)
        data.append(q)
        scales.append(s)
    return torch.cat(data, dim=1), torch.cat(scales)


def _cumsum(counts: list[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        total += c
        out.append(total)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="CPU: the emulation at a tiny shape")
    ap.add_argument(
        "--fast-backward", action="store_true",
        help="dgrad and wgrad accumulate in the fast mode too (default: forward only, as mega's "
        "dense fp8 GEMMs do)",
    )  # fmt: skip
    ap.add_argument("--aligned-only", action="store_true", help="skip router-given row counts")
    args = ap.parse_args()
    gpu = torch.cuda.is_available() and not args.smoke
    if not gpu and not args.smoke:
        raise SystemExit(
            "fp8_grouped_probe needs a CUDA GPU of compute capability 9.0 (or --smoke)"
        )
    device = torch.device("cuda" if gpu else "cpu")
    sizes = SIZES if gpu else [("tiny", 64, 32, 4, 2)]
    tokens = args.mb * args.seq if gpu else 64
    results = []
    for name, hidden, ffn, experts, topk in sizes:
        for align in (16,) if args.aligned_only else (1, 16):
            counts = _counts(tokens * topk, experts, align, torch.Generator().manual_seed(1))
            for linear, k, n in (("fc1", hidden, 2 * ffn), ("fc2", ffn, hidden)):
                row = _probe(counts, k, n, device, args.reps, gpu, args.fast_backward)
                row.update({"size": name, "linear": linear, "align": align})
                results.append(row)
                print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "."))
    (out / "fp8_grouped_probe.json").write_text(json.dumps(results, indent=1))
    if not gpu:
        return
    print(f"\n{'size':<12}{'lin':<5}{'al':>3} {'gemm':<6}{'bf16 ms':>9}{'fp8 ms':>8}{'+quant':>8}"
          f"{'x':>6}{'err':>9}")  # fmt: skip
    for row in results:
        for gemm in ("fwd", "dgrad", "wgrad"):
            head = f"{row['size']:<12}{row['linear']:<5}{row['align']:>3} {gemm:<6}"
            if f"{gemm}_fp8_error" in row:
                print(
                    f"{head}{row[f'{gemm}_bf16_ms']:>9.3f}  fp8 error: {row[f'{gemm}_fp8_error']}"
                )
                continue
            b, f, q = (float(row[f"{gemm}_{key}"]) for key in ("bf16_ms", "fp8_ms", "quant_ms"))  # type: ignore[arg-type]
            print(
                f"{head}{b:>9.3f}{f:>8.3f}{f + q:>8.3f}{b / f:>6.2f}{row[f'{gemm}_rel_err']:>9.1e}"
            )


if __name__ == "__main__":
    main()
