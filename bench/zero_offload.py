"""Optimizer CPU offload on one GPU: tokens/s and peak memory, with and without, at dp 1.

A Llama-shaped mega_models GPTModel (default: ``1b-bench``'s 24 layers, seq 2048, bf16
parameters, fp32 gradient buffers, AdamW with fp32 masters) wrapped in mega_zero_optim's
DistributedDataParallel + DistributedOptimizer at dp 1, once with the update on the device
and once with ``optimizer_offload=True`` (masters, moments and the update on the host,
fused CPU AdamW). Per mode: median step time over ``--iters`` after ``--warmup``, tokens/s,
and ``torch.cuda.max_memory_allocated``.

``--find-largest``: for each mode, grow the hidden width (heads of 128, the MLP width
derived) by doubling from ``--hidden`` until a step runs out of memory, then bisect (in
multiples of 256) to the widest that trains; one row per mode in the same table.

The offload's host copy (18 bytes a parameter) is checked against the host's available memory
before each size is built: a host out of memory kills the process instead of raising.

From the repository root, on the GPU machine (not run by the author: no GPU there):

    export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
    python3 bench/zero_offload.py                   # 1b-bench, both modes
    python3 bench/zero_offload.py --find-largest --recompute full

CPU smoke run (tiny sizes, checks the script end to end): ``python3 bench/zero_offload.py --smoke``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from mega_models import GPTModel, model_config
from mega_models.config import GPTConfig
from mega_parallel_grid import ParallelConfig, ProcessGroups, init_process_groups
from mega_zero_optim import DistributedDataParallel, DistributedOptimizer


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="1b-bench", help="a registered mega_models size")
    p.add_argument("--hidden", type=int, default=None, help="override the width (heads of 128)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--find-largest", action="store_true", help="grow the width until OOM")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, 1 iteration")
    args = p.parse_args()
    if args.smoke:
        args.model, args.hidden, args.layers, args.seq, args.batch = "tiny", 64, 2, 32, 2
        args.warmup, args.iters = 1, 1
    return args


def _groups() -> tuple[ProcessGroups, torch.device]:
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", "29517")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    groups = init_process_groups(ParallelConfig(), backend="nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return groups, device


def _config(args: argparse.Namespace, hidden: int | None) -> GPTConfig:
    config = model_config(args.model).replace(max_seq_len=max(args.seq, 2))
    if args.layers is not None:
        config = config.replace(num_layers=args.layers)
    if hidden is not None:
        heads = max(hidden // (128 if hidden >= 1024 else 16), 1)
        config = config.replace(
            hidden_size=hidden, num_attention_heads=heads, num_query_groups=None,
            ffn_hidden_size=None,
        )  # fmt: skip
    return config


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: host bytes per parameter under the offload: fp32 master, gradient, Adam's two moments,
#: and the staging copy in the parameter dtype (bf16)
_HOST_BYTES_PER_PARAM = 4 + 4 + 8 + 2


def _host_available() -> int:
    """Bytes the host can still give (MemAvailable), 0 where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _fits_host(config: GPTConfig, groups: ProcessGroups) -> bool:
    """Whether the offload's host copy of ``config`` fits in 85 % of the available memory: a
    host out of memory kills the process (no ``OutOfMemoryError`` to catch), so the search
    treats such a size as not fitting before it builds it."""
    meta = GPTModel(config, groups, device=torch.device("meta"), dtype=torch.bfloat16)
    need = sum(p.numel() for p in meta.parameters()) * _HOST_BYTES_PER_PARAM
    available = _host_available()
    if available and need > 0.85 * available:
        print(f"offload: hidden {config.hidden_size} needs {need / 2**30:.0f} GiB of host "
              f"memory, {available / 2**30:.0f} GiB available: not tried")  # fmt: skip
        return False
    return True


def _run(
    config: GPTConfig, offload: bool, args: argparse.Namespace, groups: ProcessGroups,
    device: torch.device,
) -> dict[str, Any] | None:  # fmt: skip
    """One mode at one size: step time and peak memory, or None when it ran out of memory
    (the device's, or for the offload the host's, judged before building)."""
    if offload and not _fits_host(config, groups):
        return None
    model = ddp = opt = None
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model = GPTModel(
            config, groups, recompute=args.recompute, device=device, dtype=torch.bfloat16
        )
        params = sum(p.numel() for p in model.parameters())
        ddp = DistributedDataParallel(model, dp_group=groups.dp)
        adamw = torch.optim.AdamW(ddp.parameters(), lr=1e-4, fused=True)
        opt = DistributedOptimizer(adamw, ddp, max_grad_norm=1.0, optimizer_offload=offload)
        gen = torch.Generator().manual_seed(0)
        times = []
        for i in range(args.warmup + args.iters):
            tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=gen)
            tokens = tokens.to(device)
            _sync(device)
            start = time.perf_counter()
            opt.zero_grad()
            ddp(tokens[:, :-1], tokens[:, 1:]).float().mean().backward()
            opt.step()
            _sync(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        step = statistics.median(times)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        return {
            "mode": "offload" if offload else "on device",
            "hidden": config.hidden_size,
            "layers": config.num_layers,
            "params": params,
            "step_s": step,
            "tokens_s": args.batch * args.seq / step,
            "peak_gib": peak / 2**30,
            "memory": str(opt.memory_report()),
        }
    except torch.OutOfMemoryError:
        return None
    finally:
        del model, ddp, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _largest(
    args: argparse.Namespace, offload: bool, groups: ProcessGroups, device: torch.device
) -> dict[str, Any] | None:
    """The widest model (multiple of 256) that trains in this mode."""
    width = args.hidden or _config(args, None).hidden_size
    best: dict[str, Any] | None = None
    fails: int | None = None
    while fails is None:  # double until a size fails
        row = _run(_config(args, width), offload, args, groups, device)
        if row is None:
            fails = width
        else:
            best, width = row, width * 2
    lo = best["hidden"] if best is not None else 0
    while fails - lo > 256:  # bisect between the last that trained and the first that failed
        mid = (lo + fails) // 2 // 256 * 256
        if mid <= lo:
            break
        row = _run(_config(args, mid), offload, args, groups, device)
        if row is None:
            fails = mid
        else:
            best, lo = row, mid
    return best


def _table(rows: list[dict[str, Any]]) -> str:
    head = f"{'mode':<10} {'hidden':>7} {'layers':>6} {'params':>9} {'step s':>8} "
    head += f"{'tokens/s':>10} {'peak GiB':>9}  memory report"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['mode']:<10} {r['hidden']:>7} {r['layers']:>6} {r['params'] / 1e9:>8.2f}B "
            f"{r['step_s']:>8.3f} {r['tokens_s']:>10,.0f} {r['peak_gib']:>9.1f}  {r['memory']}"
        )
    return "\n".join(lines)


def main() -> None:
    args = _args()
    groups, device = _groups()
    rows: list[dict[str, Any]] = []
    for offload in (False, True):
        if args.find_largest:
            row = _largest(args, offload, groups, device)
        else:
            row = _run(_config(args, args.hidden), offload, args, groups, device)
        if row is None:
            mode = "offload" if offload else "on device"
            print(f"{mode}: out of memory at the smallest size tried")
        else:
            rows.append(row)
    print(_table(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
