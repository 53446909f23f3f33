"""``train.fp8_weight_cache`` on the GPU: the cached run against the uncached one, compiled.

On CPU the cache is checked bit for bit (``packages/tp-layers/tests/test_fp8_weight_cache.py``,
``apps/pretrain/tests/test_fp8_weight_cache_train.py``). On a GPU some kernels of the step are
not deterministic (attention's backward accumulates with atomics), so two uncached runs already
differ; this runs three trainers from the same seed on the same batches, uncached twice and
cached once, and prints each step's loss and the largest relative difference of the cached
run from the first uncached one beside that of the two uncached ones. A cache read stale
(not invalidated after a step) or wrong would stand far above the run-to-run difference from
the second step on.

    python3 bench/fp8_cache_check.py --size 1b-bench --mb 1 --accum 4 --steps 4   # one GPU
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch
from _world import init_world

from mega_parallel_grid import init_process_groups
from mega_pretrain.build import build, param_dtype
from mega_pretrain.config import load_config
from mega_pretrain.plan import plan_for
from mega_pretrain.step import StepRunner


def _losses(
    device: torch.device, shape: tuple[str, int, int, int, int], cache: bool
) -> list[float]:
    size, mb, accum, seq, steps = shape
    compiled = device.type == "cuda"  # --smoke: eager on CPU, the fp8 GEMMs emulated
    overrides = [
        ("model.size", size), ("train.seq_len", str(seq)), ("train.micro_batch_size", str(mb)),
        ("train.precision", "bf16"), ("train.fp8", "true"),
        ("train.compile", str(compiled).lower()),
        ("train.fp8_weight_cache", str(cache).lower()),
    ]  # fmt: skip
    config = load_config(None, overrides)
    config = replace(config, train=replace(config.train, global_batch_size=mb * accum))
    plan = plan_for(config, 1)
    groups = init_process_groups(plan.parallel)
    torch.manual_seed(0)
    built = build(config, groups, device)
    runner = StepRunner(
        built, groups, seq_len=seq, micro_batch_size=mb, hidden_size=plan.model.hidden_size,
        dtype=param_dtype(config), device=device, sequence_parallel=False,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):  # a new global batch each step
        tokens = torch.randint(0, plan.model.vocab_size, (accum, mb, seq + 1), generator=gen)
        batches = [(t[:, :-1].to(device), t[:, 1:].to(device)) for t in tokens]
        losses.append(float(runner.train_step(batches, 3e-4)[0]))
    del runner, built
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1b-bench")
    ap.add_argument("--mb", type=int, default=1)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model: the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.size, args.seq = "tiny", 64
    device = init_world(args.smoke)
    shape = (args.size, args.mb, args.accum, args.seq, args.steps)
    plain, again, cached = (_losses(device, shape, cache) for cache in (False, False, True))
    noise = max(abs(a - b) / abs(a) for a, b in zip(plain, again, strict=True))
    gap = max(abs(a - c) / abs(a) for a, c in zip(plain, cached, strict=True))
    print(json.dumps({"uncached": plain, "uncached_again": again, "cached": cached}))
    print(f"largest relative loss difference: uncached twice {noise:.2e}, cached {gap:.2e}")


if __name__ == "__main__":
    main()
