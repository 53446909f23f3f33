"""The fp32 main-grad accumulation alone: one step's worth at a model's parameter shapes.

    python3 bench/grad_accum.py --size deepseek-3b --accum 4     # one GPU
    python3 bench/grad_accum.py --smoke                          # CPU: checks that it runs

mega-zero-optim's DDP adds each parameter's bf16 gradient into its fp32 ``main_grad`` after
every micro-batch (a copy for the step's first). On the H200 (2026-12-05) these took 38.7 ms
of `deepseek-3b`'s 411 ms step at 4 micro-batches: 324 launches of ATen's mixed-dtype add.
Each line runs the same accumulation over every parameter of the model (shapes built on the
meta device), ``--accum`` micro-batches, and reports the GPU time and the bandwidth it
reached (bytes: bf16 read + fp32 read + fp32 write per element; the copy reads no fp32):

- ``aten``: ``main.copy_(g)`` then ``main.add_(g)``, as the hook ran until 2026-12-05;
- ``inductor``: the same ops compiled once on flat views (``dynamic=True``), so one
  generated Triton kernel serves every size;
- ``mega``: ``mega_zero_optim.accumulate_grad``, what the DDP hook runs now: on CUDA the
  project's Triton kernel (bf16 widened and added in fp32, 4096 elements a program).

Each line checks its result against ``aten``'s (equal: one fp32 rounding of the same sum).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

Accumulate = Callable[[Tensor, Tensor, bool], None]


def _shapes(size: str) -> list[tuple[int, ...]]:
    from mega_models.gpt import GPTModel
    from mega_models.registry import model_config
    from mega_parallel_grid.testing.solo import solo_groups

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29561", rank=0, world_size=1)
    model = GPTModel(model_config(size), solo_groups(), device="meta")
    return [tuple(p.shape) for p in model.parameters()]


def _aten(main: Tensor, g: Tensor, first: bool) -> None:
    if first:
        main.copy_(g)
    else:
        main.add_(g)


def _inductor() -> Accumulate:
    @torch.compile(dynamic=True, fullgraph=True)
    def add(main: Tensor, g: Tensor) -> None:
        main.add_(g)

    @torch.compile(dynamic=True, fullgraph=True)
    def copy(main: Tensor, g: Tensor) -> None:
        main.copy_(g)

    def run(main: Tensor, g: Tensor, first: bool) -> None:
        (copy if first else add)(main.view(-1), g.view(-1))

    return run


def _mega(main: Tensor, g: Tensor, first: bool) -> None:
    from mega_zero_optim import accumulate_grad

    accumulate_grad(main, g, first=first)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="deepseek-3b")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU, moe-tiny")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda" if cuda else "cpu")
    a.size = "moe-tiny" if a.smoke else a.size
    shapes = _shapes(a.size)
    gen = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(s, generator=gen, device=device).bfloat16() for s in shapes]
    elems = sum(g.numel() for g in grads)
    nbytes = elems * (2 + 4) + (a.accum - 1) * elems * (2 + 4 + 4)
    variants: dict[str, Accumulate] = {"aten": _aten, "inductor": _inductor(), "mega": _mega}
    ref: list[Tensor] | None = None
    rows = []
    for name, fn in variants.items():
        mains = [torch.zeros(s, device=device) for s in shapes]

        def step(fn: Accumulate = fn, mains: list[Tensor] = mains) -> None:
            for i in range(a.accum):
                for m, g in zip(mains, grads, strict=True):
                    fn(m, g, i == 0)

        step()  # warm-up (compiles)
        if ref is None:
            ref = [m.clone() for m in mains]
        equal = all(torch.equal(m, r) for m, r in zip(mains, ref, strict=True))
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(a.iters):
                step()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / a.iters
        else:
            ms = float("nan")
        rows.append({"variant": name, "ms": ms, "GB/s": nbytes / ms / 1e6, "equal": equal})
        print(f"{name:<10} {ms:8.2f} ms  {nbytes / ms / 1e6:8.0f} GB/s  equal to aten: {equal}",
              flush=True)  # fmt: skip
    print(f"\n{a.size}: {len(shapes)} parameters, {elems / 1e9:.3f} G elements, "
          f"{a.accum} micro-batches, {nbytes / 1e9:.1f} GB moved a step")  # fmt: skip
    print("| variant | ms a step | GB/s | equal to aten |\n|---|---:|---:|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['ms']:.2f} | {r['GB/s']:.0f} | {r['equal']} |")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "grad_accum.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
