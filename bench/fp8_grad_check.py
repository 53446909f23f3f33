"""How far FP8 moves the loss and the gradient of one step, next to how far bf16 moves them.

    python3 bench/fp8_grad_check.py --size 1b-bench --mb 2        # one GPU
    python3 bench/fp8_grad_check.py --smoke                        # CPU, tiny, emulated fp8

Builds the trainer's model from the same seed in fp32, bf16, and bf16 + FP8 GEMMs for each
scaling of ``--recipes`` (``--compile``: the low-precision runs compiled), runs one
forward-backward on the same random tokens and compares each low-precision run's
loss and gradient (the fp32 ``main_grad`` buffers) with the fp32 run's: relative loss error,
cosine of the whole gradient, relative error of its norm, and the worst per-parameter cosine.
FP8 is fine when its errors are of the order of bf16's, not when they are zero.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re

import torch
import torch.distributed as dist
from torch import Tensor

from mega_parallel_grid import init_process_groups
from mega_pretrain.build import build, gpt_config, parallel_config
from mega_pretrain.config import load_config
from mega_pretrain.runtime import collective_timeout, start_distributed
from mega_pretrain.step import StepRunner


def run(size: str, mb: int, seq: int, precision: str, fp8: str, device: torch.device,
        tokens: Tensor, compile_: bool = False) -> tuple[float, dict[str, Tensor]]:  # fmt: skip
    """One forward-backward; ``fp8``: "" (none) or the recipe's scaling."""
    overrides = [
        ("model.size", size), ("train.seq_len", str(seq)), ("train.micro_batch_size", str(mb)),
        ("train.global_batch_size", str(mb)), ("train.precision", precision),
        ("train.fp8", str(bool(fp8)).lower()), ("train.compile", str(compile_).lower()),
    ]  # fmt: skip
    if fp8:
        overrides.append(("train.fp8_recipe", fp8))
    config = load_config(None, overrides)
    model = gpt_config(config)
    groups = init_process_groups(parallel_config(config))
    built = build(config, groups, device)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    runner = StepRunner(
        built, groups, seq_len=seq, micro_batch_size=mb, hidden_size=model.hidden_size,
        dtype=dtype, device=device, sequence_parallel=False,
    )  # fmt: skip
    for ddp in built.ddps:
        ddp.zero_grad_buffer()
    loss = runner._run([(tokens[:, :-1], tokens[:, 1:])], forward_only=False)
    for ddp in built.ddps:
        ddp.finish_grad_sync()
    grads = {
        name: p.main_grad.detach().float().cpu()  # type: ignore[attr-defined]
        for chunk in built.chunks
        for name, p in chunk.named_parameters()
    }
    value = float(loss)
    del built, runner
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return value, grads


def compare(ref: dict[str, Tensor], got: dict[str, Tensor]) -> dict[str, float]:
    a = torch.cat([ref[k].flatten() for k in ref]).double()
    b = torch.cat([got[k].flatten() for k in ref]).double()
    worst, worst_name = 1.0, ""
    for k in ref:
        x, y = ref[k].double().flatten(), got[k].double().flatten()
        if x.norm() > 0:
            c = float(torch.dot(x, y) / (x.norm() * y.norm()).clamp_min(1e-300))
            if c < worst:
                worst, worst_name = c, k
    return {
        "grad_cosine": float(torch.dot(a, b) / (a.norm() * b.norm())),
        "grad_norm_rel_err": float((b.norm() - a.norm()).abs() / a.norm()),
        "grad_rel_err": float((b - a).norm() / a.norm()),
        "worst_param_cosine": worst,
        "worst_param": worst_name,  # type: ignore[dict-item]
    }


def by_kind(ref: dict[str, Tensor], got: dict[str, Tensor]) -> dict[str, float]:
    """The gradient cosine of each kind of parameter over every layer (the name without its
    layer index, e.g. ``attention.qkv.weight``): a backward that stops at some linear's input
    shows as a cosine near 0 for the weights below it."""
    kinds: dict[str, list[str]] = {}
    for name in ref:
        kinds.setdefault(re.sub(r"(^|\.)\d+\.", r"\1", name), []).append(name)
    cos = {}
    for kind, names in sorted(kinds.items()):
        a = torch.cat([ref[n].flatten() for n in names]).double()
        b = torch.cat([got[n].flatten() for n in names]).double()
        cos[kind] = float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-300))
    return cos


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1b-bench")
    ap.add_argument("--mb", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--recipes", default="tensor", help="fp8 scalings, comma-separated")
    ap.add_argument(
        "--compile", action="store_true", help="train.compile for the low-precision runs"
    )
    a = ap.parse_args()
    if a.smoke:
        a.size, a.mb, a.seq = "tiny", 2, 64
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    start_distributed(device, collective_timeout(10))
    vocab = gpt_config(load_config(None, [("model.size", a.size)])).vocab_size
    tokens = torch.randint(0, vocab, (a.mb, a.seq + 1), generator=torch.Generator().manual_seed(7))
    tokens = tokens.to(device)
    ref_loss, ref = run(a.size, a.mb, a.seq, "fp32", False, device, tokens)
    rows = []
    runs = [("bf16", "")] + [(f"fp8 {r}", r) for r in a.recipes.split(",")]
    for label, fp8 in runs:
        loss, grads = run(a.size, a.mb, a.seq, "bf16", fp8, device, tokens, a.compile)
        row = {"run": label, "loss": loss, "loss_rel_err": abs(loss - ref_loss) / ref_loss}
        row.update(compare(ref, grads))
        row["cosine_by_kind"] = by_kind(ref, grads)  # type: ignore[assignment]
        rows.append(row)
        del grads
    print(f"fp32 loss {ref_loss:.6f}  ({a.size}, mb {a.mb}, seq {a.seq})")
    print(f"{'run':10} {'loss':>10} {'loss err':>9} {'grad cos':>10} {'|g| err':>8} "
          f"{'g rel err':>9} {'worst cos':>9}  worst parameter")  # fmt: skip
    for r in rows:
        print(f"{r['run']:10} {r['loss']:10.6f} {r['loss_rel_err']:9.2e} {r['grad_cosine']:10.6f} "
              f"{r['grad_norm_rel_err']:8.2e} {r['grad_rel_err']:9.2e} "
              f"{r['worst_param_cosine']:9.5f}  {r['worst_param']}")  # fmt: skip
    print("gradient cosine by kind of parameter (every layer's together):")
    for kind in rows[0]["cosine_by_kind"]:  # type: ignore[attr-defined]
        cells = "  ".join(f"{r['run']}: {r['cosine_by_kind'][kind]:.5f}" for r in rows)  # type: ignore[index]
        print(f"  {kind:<40} {cells}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "fp8_grad_check.json"), "w") as f:
            json.dump({"fp32_loss": ref_loss, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
