"""Causal SDPA alone at a model's attention shape, forward and forward + backward, for each
kernel torch offers on this GPU (FlashAttention-2, cuDNN, memory-efficient), eager and under
``torch.compile`` with the trainer's ``train.attention_kernel`` priority set before tracing,
with TFLOP/s and each kernel's error against fp32 math.

On the GPU machine, from the repository root (one GPU; the table prints last):

    export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
    python3 bench/attn_kernels.py                    # 1b-bench: b 8, 16 heads of 128, s 2048
    python3 bench/attn_kernels.py --batch 2 --head-dim 192 --v-head-dim 128 \
        --kernels flash-pad,cudnn,efficient          # deepseek-v3-3b's MLA at mb 2
    python3 bench/attn_kernels.py --kernels flash,cudnn,fa4   # with flash-attn-4 installed

``fa4`` (``train.attention_kernel fa4``) activates FlashAttention-4 behind the flash backend
for the rest of the process, so it goes last in ``--kernels``.

FLOPs of causal attention, forward: ``2 * b * h * s^2 * (d_qk + d_v) / 2`` (QK^T and PV,
half the square); forward + backward: 3.5x the forward (backward recomputes QK^T and does
four more products of that size: 2.5x). Values narrower than the queries (MLA): a kernel
named ``<kernel>-pad`` zero-pads them to the qk dim and slices the output back, as
``mega_models.mla.latent_sdpa`` does (its FLOPs are still counted at the true ``d_v``). With $OUT set, the rows also go to $OUT/attn_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from mega_pretrain.runtime import configure_attention_kernel, sdpa_backend


def _sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _sdpa_padded(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    dv = v.shape[-1]
    v = F.pad(v, (0, q.shape[-1] - dv))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)[..., :dv]


def _error(
    kernel: str, q: Tensor, k: Tensor, v: Tensor, dy: Tensor, padded: bool
) -> dict[str, float]:
    """Max |error| of output and input gradients against fp32 math, relative to the fp32
    reference's largest magnitude; ``kernel`` alone enabled (an error if it cannot run)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(sdpa_backend(kernel)):
        out = (_sdpa_padded if padded else _sdpa)(*ins)
        grads = torch.autograd.grad(out, ins, dy)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        ref = _sdpa(*ref_in)
    ref_grads = torch.autograd.grad(ref, ref_in, dy.float())
    pairs = {"out": (out, ref), "dq": (grads[0], ref_grads[0]),
             "dk": (grads[1], ref_grads[1]), "dv": (grads[2], ref_grads[2])}  # fmt: skip
    return {
        name: float((a.float() - r).abs().max() / r.abs().max().clamp_min(1e-30))
        for name, (a, r) in pairs.items()
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--v-head-dim", type=int, default=0, help="default: --head-dim")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--kernels", default="flash,cudnn,efficient")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("attn_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ssd_kernels import measure

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    dv = args.v_head_dim or args.head_dim
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k = (torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen) for _ in "qk")
    v, dy = (torch.randn((*shape[:3], dv), device=dev, dtype=torch.bfloat16, generator=gen)
             for _ in "vd")  # fmt: skip
    fwd_flop = 2 * args.batch * args.heads * args.seq**2 * (args.head_dim + dv) / 2
    default = torch._C._get_sdp_priority_order()
    rows: dict[str, dict[str, float] | str] = {}
    for name in args.kernels.split(","):
        kernel, padded = name.removesuffix("-pad"), name.endswith("-pad")
        torch._C._set_sdp_priority_order(default)
        try:
            configure_attention_kernel(dev, kernel)
        except ValueError as err:  # fa4 where it cannot run: its sentence, and the rest runs
            rows[name] = f"refused: {err}"
            print(f"{name}: {rows[name]}", flush=True)
            continue
        for mode in ("eager", "compiled"):
            label = f"{name} {mode}"
            plain = _sdpa_padded if padded else _sdpa
            fn = torch.compile(plain) if mode == "compiled" else plain
            torch._dynamo.reset()
            try:
                row = measure(fn, [q, k, v], dy, args.warmup, args.iters)
                row["fwd TFLOP/s"] = fwd_flop / row["fwd_ms"] / 1e9
                row["fwd+bwd TFLOP/s"] = 3.5 * fwd_flop / row["fwd_bwd_ms"] / 1e9
                if mode == "eager":
                    errors = _error(kernel, q, k, v, dy, padded)
                    row |= {f"err {n}": e for n, e in errors.items()}
                rows[label] = row
            except Exception as err:  # one failing line does not stop the table
                rows[label] = f"failed: {type(err).__name__}: {str(err)[:300]}"
            print(f"{label}: {rows[label]}", flush=True)
    torch._C._set_sdp_priority_order(default)
    print(f"\nCausal SDPA, b {args.batch} h {args.heads} s {args.seq} d {args.head_dim} d_v {dv}, bf16, "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    print("| kernel | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | worst rel. error |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, row in rows.items():
        if isinstance(row, str):
            print(f"| {label} | {row} |")
            continue
        errs = [v for n, v in row.items() if n.startswith("err ")]
        worst = f"{max(errs):.1e}" if errs else ""
        print(f"| {label} | {row['fwd_ms']:.3f} | {row['fwd_bwd_ms']:.3f} | "
              f"{row['fwd TFLOP/s']:.0f} | {row['fwd+bwd TFLOP/s']:.0f} | {worst} |")  # fmt: skip
    out = os.environ.get("OUT")
    if out:
        Path(out, "attn_kernels.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
