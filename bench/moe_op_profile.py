"""Which operators of one MoE layer's forward + backward take the GPU time (CUDA only).

    python3 bench/moe_op_profile.py --size moe-2b [--compile]

Builds the MoE layer of a registry size (its router, experts and shared expert), runs
forward + backward on ``[4096, 4, hidden]`` bf16 tokens, profiles three steps after a
warm-up and prints the operators by device time, then where the fills and index kernels
were launched from (Python stack, 8 frames). Writes the text to ``$OUT/moe_ops_<size>.txt``.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from mega_models import model_config
from mega_moe import MoELayer
from mega_parallel_grid import ParallelConfig, init_process_groups


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="moe-2b")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--tokens", type=int, default=16384)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl")
    groups = init_process_groups(ParallelConfig())
    device = torch.device("cuda")
    c = model_config(a.size)
    layer = MoELayer(
        c.hidden_size, c.moe_config(), ep_group=groups.ep, etp_group=groups.etp,
        tp_group=groups.tp, seed=0, name="moe", dtype=torch.bfloat16, device=device,
    )  # fmt: skip
    run = torch.compile(layer) if a.compile else layer
    x = torch.randn(a.tokens // 4, 4, c.hidden_size, device=device, dtype=torch.bfloat16)
    x.requires_grad_(True)
    dy = torch.randn_like(x)

    def step() -> None:
        out = run(x)
        assert layer.last_stats is not None
        ((out.float() * dy).sum() + layer.last_stats.loss).backward()
        x.grad = None
        layer.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        step()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 10
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], with_stack=True) as p:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    label = f"{a.size}{' compiled' if a.compile else ''}"
    lines = [f"== {label}: {ms:.2f} ms per forward + backward of one MoE layer, {a.tokens} tokens"]
    lines.append(p.key_averages().table(sort_by="self_device_time_total", row_limit=30))
    lines.append("== launched from (fills, index, bmm):")
    stacks = p.key_averages(group_by_stack_n=8)
    picked = [
        e for e in stacks
        if any(k in e.key for k in ("fill_", "zero_", "index", "bmm", "scatter", "full"))
        and e.self_device_time_total > 0
    ]  # fmt: skip
    for e in sorted(picked, key=lambda e: -e.self_device_time_total)[:12]:
        lines.append(f"{e.key}  {e.self_device_time_total / 3e3:.3f} ms/step  calls {e.count}")
        lines.extend(f"    {frame}" for frame in e.stack)
    text = "\n".join(lines)
    print(text, flush=True)
    out = os.environ.get("OUT")
    if out:
        name = f"moe_ops_{a.size}{'_compiled' if a.compile else ''}.txt"
        with open(os.path.join(out, name), "w") as f:
            f.write(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
