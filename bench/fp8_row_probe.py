"""Which part of row-wise FP8 does ``torch.compile`` get wrong? One linear, piece by piece.

    python3 bench/fp8_row_probe.py            # one GPU (sm89+), a few seconds a line
    python3 bench/fp8_row_probe.py --smoke    # CPU: emulated GEMMs, only checks that it runs

On the H200 (torch 2.11, 2026-12-05) one compiled row-wise ``1b-bench`` layer gave every
weight gradient as zeros while its forward matched eager (``bench/fp8_compile_check.py``);
tensor- and block-wise matched. Row-wise is the one recipe whose gradients are e5m2 *and*
scaled per row, so each line here compiles one piece alone, eager against compiled on the
same inputs, with the gradient format as the variable:

- ``quantize``: ``quantize_tiles`` of a gradient per row (dgrad's tiles) and per column
  (wgrad's), dequantised;
- ``gemm``: ``torch._scaled_mm`` called directly (so Inductor lowers it itself) on
  already-quantised row-wise operands with ``[M, 1]`` / ``[1, N]`` scales: dgrad's with and
  without fast accumulation, and wgrad's (both scaled along the tokens, the gradient
  transposed); "eager vs fp32 product" checks the library's GEMM against the exact product;
- ``linear``: ``fp8_linear`` as the library runs it, the forward compiled and its backward
  by AOTAutograd, as a compiled layer runs.

On the GPU (H100, torch 2.11, 2026-12-05) every piece compiled alone equalled eager, in e5m2
and e4m3 alike, while the compiled ``linear`` gave zero ``dx`` and ``dw``: the defect is in
how the row-wise branch of ``_Fp8Linear``'s backward is traced, not in a kernel. The cause
(found on CPU under torch 2.11): the GEMM result returned through a no-op ``.to(dtype)``,
which AOTAutograd's backward graph replaced by zeros; ``fp8_scaling.as_dtype`` mends it, and
compiled row-wise gave eager's gradients on an H100 (2026-12-06). Kept as the tool for the
next such defect.

Each line prints the cosine and relative error of compiled against eager, and of eager
against the fp32 product of the same values; a cosine near 0 or a zero norm names the piece.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import Tensor

from mega_tp_layers import Fp8Recipe, fp8_linear
from mega_tp_layers.fp8_scaling import Fp8Tiles, operand_tile, quantize_tiles, tiled_gemm

_FORMATS = {"e5m2": torch.float8_e5m2, "e4m3": torch.float8_e4m3fn}


def _cmp(ref: Tensor, got: Tensor) -> str:
    x, y = ref.double().flatten(), got.double().flatten()
    cos = float(torch.dot(x, y) / (x.norm() * y.norm()).clamp_min(1e-300))
    rel = float((y - x).norm() / x.norm().clamp_min(1e-300))
    return f"cos {cos:.6f} rel {rel:.2e} |ref| {float(x.norm()):.4e} |got| {float(y.norm()):.4e}"


def _raw(a: Fp8Tiles, b: Fp8Tiles, fast: bool) -> Tensor:
    """``torch._scaled_mm`` called directly (what Inductor lowers itself), row-wise scales."""
    out: Tensor = torch._scaled_mm(
        a.data.contiguous(), b.data.t().contiguous().t(),
        scale_a=a.inv_scale.reshape(-1).view(a.inv_scale.shape),
        scale_b=b.inv_scale.reshape(-1).view(b.inv_scale.shape),
        out_dtype=torch.bfloat16, use_fast_accum=fast,
    )  # fmt: skip
    return out.float()


def _patch_row_clone() -> None:
    """The row GEMM returns a fresh tensor even when its dtype is already the one asked."""
    import mega_tp_layers.fp8_scaling as fs

    def row(a: Fp8Tiles, b: Fp8Tiles, out_dtype: torch.dtype, fast: bool) -> Tensor:
        out: Tensor = torch._scaled_mm(
            a.data.contiguous(), b.data.t().contiguous().t(),
            scale_a=a.inv_scale.reshape(-1).view(a.inv_scale.shape),
            scale_b=b.inv_scale.reshape(-1).view(b.inv_scale.shape),
            out_dtype=out_dtype, use_fast_accum=fast,
        )  # fmt: skip
        return out

    fs._row_scaled_mm = row


def _linears(
    backends: list[str], name: str, recipe: Fp8Recipe, x: Tensor, w: Tensor, dy: Tensor,
    rows: dict[str, str],
) -> None:  # fmt: skip
    """``fp8_linear`` eager against compiled by each backend: which stage zeroes dx and dw."""

    def fwd_only(xx: Tensor, ww: Tensor) -> Tensor:
        return fp8_linear(xx, ww, recipe=recipe)

    def lin(f: object) -> tuple[Tensor, ...]:
        xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
        out = f(xl, wl)  # type: ignore[operator]
        dx, dw = torch.autograd.grad(out, (xl, wl), dy)
        return out.detach(), dx, dw

    for backend in backends:
        label = f"linear {name} {backend} out, dx, dw"
        try:  # compiled as the trainer compiles a layer: the forward, its backward by AOTAutograd
            eager = lin(fwd_only)
            compiled = lin(torch.compile(fwd_only, dynamic=False, backend=backend))
            rows[label] = " ; ".join(_cmp(e, c) for e, c in zip(eager, compiled, strict=True))
        except Exception as err:
            rows[label] = f"failed: {type(err).__name__}: {str(err)[:200]}"
        print(f"{label:<34} {rows[label]}", flush=True)
        torch._dynamo.reset()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=4096, help="tokens")
    ap.add_argument("--k", type=int, default=2048, help="in features")
    ap.add_argument("--n", type=int, default=5632, help="out features")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny, emulated fp8")
    ap.add_argument("--backends", default="inductor",
                    help="torch.compile backends for the linear line, comma-separated: "
                         "aot_eager (AOTAutograd's graphs run eagerly), "
                         "aot_eager_decomp_partition, inductor")  # fmt: skip
    ap.add_argument("--linear-only", action="store_true", help="only the linear lines")
    ap.add_argument(
        "--explain",
        action="store_true",
        help="graph breaks of the compiled linear per scaling (torch._dynamo.explain)",
    )
    ap.add_argument("--same-dtype-alias", choices=("keep", "clone"), default="keep",
                    help="clone: the row GEMM's bf16 result is cloned rather than returned "
                         "by a no-op .to(bf16), which returns its input itself")  # fmt: skip
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if a.smoke:
        a.m, a.k, a.n = 64, 32, 48
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(a.m, a.k, generator=gen).to(device, dtype)
    w = (torch.randn(a.n, a.k, generator=gen) * a.k**-0.5).to(device, dtype)
    dy = torch.randn(a.m, a.n, generator=gen).to(device, dtype)
    rows: dict[str, str] = {}
    if a.same_dtype_alias == "clone":
        _patch_row_clone()
    if a.explain:
        for scaling in ("tensor", "row", "block"):
            rec = Fp8Recipe(scaling=scaling)  # type: ignore[arg-type]
            xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
            ex = torch._dynamo.explain(lambda xx, ww, r=rec: fp8_linear(xx, ww, recipe=r))(xl, wl)
            reasons = "; ".join(str(b.reason)[:160] for b in ex.break_reasons)
            print(f"explain {scaling}: {ex.graph_count} graphs, {ex.graph_break_count} breaks "
                  f"{reasons}", flush=True)  # fmt: skip
            torch._dynamo.reset()

    def line(label: str, fn: object, *args: object) -> None:
        try:
            eager = fn(*args)  # type: ignore[operator]
            compiled = torch.compile(fn, dynamic=False)(*args)  # type: ignore[arg-type]
            outs = eager if isinstance(eager, tuple) else (eager,)
            comps = compiled if isinstance(compiled, tuple) else (compiled,)
            rows[label] = " ; ".join(_cmp(e, c) for e, c in zip(outs, comps, strict=True))
        except Exception as err:  # one failing piece does not stop the others
            rows[label] = f"failed: {type(err).__name__}: {str(err)[:200]}"
        print(f"{label:<34} {rows[label]}", flush=True)
        torch._dynamo.reset()

    for name, fmt in _FORMATS.items():
        recipe = Fp8Recipe(scaling="row", grad_dtype=fmt)
        if a.linear_only:
            _linears(a.backends.split(","), name, recipe, x, w, dy, rows)
            continue
        for what, contracted in (("dgrad tiles", 1), ("wgrad tiles", 0)):
            tile = operand_tile("row", contracted, False)
            line(f"quantize {name} {what}",
                 lambda t, tile=tile, fmt=fmt: quantize_tiles(t, fmt, 1e-12, tile).dequantize(),
                 dy)  # fmt: skip
        g_rows = quantize_tiles(dy, fmt, 1e-12, operand_tile("row", 1, False))
        w_cols = quantize_tiles(w, torch.float8_e4m3fn, 1e-12, operand_tile("row", 0, True))
        ref = g_rows.dequantize() @ w_cols.dequantize()
        for fwd in (True, False):
            label = f"gemm {name} dgrad fast={fwd}"
            line(label, lambda ga, wb, fwd=fwd: _raw(ga, wb, fwd), g_rows, w_cols)
            got = tiled_gemm(g_rows, w_cols, torch.float32, recipe, forward=fwd)
            print(f"{'  eager vs fp32 product':<34} {_cmp(ref, got)}", flush=True)
        g_cols = quantize_tiles(dy, fmt, 1e-12, operand_tile("row", 0, False)).t()  # [N, M]
        x_cols = quantize_tiles(x, torch.float8_e4m3fn, 1e-12, operand_tile("row", 0, False))
        ref = g_cols.dequantize() @ x_cols.dequantize()
        line(f"gemm {name} wgrad", lambda ga, xb: _raw(ga, xb, False), g_cols, x_cols)
        got = tiled_gemm(g_cols, x_cols, torch.float32, recipe, forward=False)
        print(f"{'  eager vs fp32 product':<34} {_cmp(ref, got)}", flush=True)

        _linears(a.backends.split(","), name, recipe, x, w, dy, rows)
    print("\n| piece | compiled against eager |\n|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r} |")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "fp8_row_probe.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
