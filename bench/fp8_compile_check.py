"""Does ``torch.compile`` change what one FP8 transformer layer computes? Eager against compiled.

    python3 bench/fp8_compile_check.py --size 1b-bench --scalings tensor,row   # one GPU
    python3 bench/fp8_compile_check.py --smoke                                 # CPU, tiny

Builds one layer of ``--size`` per scaling (bf16 on a GPU, fp32 on the CPU) with FP8 GEMMs,
runs it eagerly and then compiled, as the trainer compiles it (``layer.compile()``), on the
same input and output gradient, and prints the cosine and relative error of the output, the
input gradient and each parameter's gradient, compiled against eager. Both sides quantise the
same values, so they should agree to the bf16 rounding of their different kernels (cosine
above ~0.999). A gradient with a cosine near 0, or a zero norm, is where the compiled graph
departs: for row-wise scaling, whose compiled training reached a loss far below bf16's on the
H200 (2026-12-01), this names the GEMM. With $OUT set, the rows also go to
$OUT/fp8_compile_check.json. A few seconds a scaling after the compile.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from _world import init_world
from torch import Tensor

from mega_models import spec_for, stage_spec
from mega_models.rope import rope_for
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_tp_layers import Fp8Recipe


def _compare(a: Tensor | None, b: Tensor | None) -> dict[str, float]:
    """Cosine and relative error of ``b`` (compiled) against ``a`` (eager), and both norms."""
    if a is None or b is None:
        return {"cosine": float("nan"), "rel_err": float("nan"),
                "eager_norm": float("nan") if a is None else float(a.norm()),
                "compiled_norm": float("nan") if b is None else float(b.norm())}  # fmt: skip
    x, y = a.detach().double().flatten(), b.detach().double().flatten()
    denom = (x.norm() * y.norm()).clamp_min(1e-300)
    return {
        "cosine": float(torch.dot(x, y) / denom),
        "rel_err": float((y - x).norm() / x.norm().clamp_min(1e-300)),
        "eager_norm": float(x.norm()),
        "compiled_norm": float(y.norm()),
    }


def _recipe(spec: str) -> Fp8Recipe:
    """``tensor``, ``row``, ``block``, each optionally ``:e4m3`` / ``:e5m2`` (gradients' format)."""
    scaling, _, grad = spec.partition(":")
    formats = {"": None, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    return Fp8Recipe(scaling=scaling, grad_dtype=formats[grad])  # type: ignore[arg-type]


def _run(
    layer: torch.nn.Module, x: Tensor, rope: object, seq: int, dy: Tensor
) -> dict[str, Tensor | None]:
    """Output, input gradient and every parameter's gradient of one forward + backward."""
    for p in layer.parameters():
        p.grad = None
    leaf = x.detach().clone().requires_grad_()
    out = layer(leaf, rope, seq)
    out.backward(dy)
    grads: dict[str, Tensor | None] = {"output": out.detach(), "input grad": leaf.grad}
    grads |= {name: p.grad for name, p in layer.named_parameters()}
    return grads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1b-bench")
    ap.add_argument("--layer", default="1", help="which layer of the model to build and check")
    ap.add_argument("--mb", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument(
        "--scalings", default="tensor,row",
        help="fp8 scalings, comma-separated; SCALING:e4m3 or SCALING:e5m2 sets the gradients' "
             "format (row:e4m3, say)",
    )  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny, emulated fp8")
    a = ap.parse_args()
    if a.smoke:
        a.size, a.mb, a.seq = "tiny", 2, 64
    device = init_world(a.smoke)
    cuda = device.type == "cuda"
    groups = init_process_groups(ParallelConfig())
    dtype = torch.bfloat16 if cuda else torch.float32
    spec = spec_for(a.size)
    config = spec.sizes[a.size]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(a.seq, a.mb, config.hidden_size, generator=gen).to(device, dtype)
    dy = torch.randn(a.seq, a.mb, config.hidden_size, generator=gen).to(device, dtype)
    rope = rope_for(config, torch.arange(a.seq, device=device), dtype)
    rows: dict[str, dict[str, dict[str, float]] | str] = {}
    for scaling in a.scalings.split(","):
        torch.manual_seed(0)
        try:
            model = spec.build(
                config, groups, stage_spec(config.num_layers), device=device, dtype=dtype,
                fp8=_recipe(scaling),
            )  # fmt: skip
            layer = model.layers[a.layer]
            eager = _run(layer, x, rope, a.seq, dy)
            layer.compile()
            compiled = _run(layer, x, rope, a.seq, dy)
            rows[scaling] = {name: _compare(eager[name], compiled[name]) for name in eager}
            del model, layer
        except Exception as err:  # one failing scaling does not stop the others
            rows[scaling] = f"failed: {type(err).__name__}: {str(err)[:300]}"
        print(f"{scaling}: {rows[scaling]}", flush=True)
        torch._dynamo.reset()
        if cuda:
            torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"\nFP8 layer {a.layer} of {a.size}, compiled against eager (mb {a.mb}, seq {a.seq}, "
          f"{str(dtype).removeprefix('torch.')}, {device_name})")  # fmt: skip
    print("| scaling | tensor | cosine | rel. error | eager norm | compiled norm |")
    print("|---|---|---:|---:|---:|---:|")
    for scaling, per in rows.items():
        if isinstance(per, str):
            print(f"| {scaling} | {per} | | | | |")
            continue
        for name, r in per.items():
            print(f"| {scaling} | {name} | {r['cosine']:.6f} | {r['rel_err']:.2e} | "
                  f"{r['eager_norm']:.4e} | {r['compiled_norm']:.4e} |")  # fmt: skip
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "fp8_compile_check.json"), "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
