"""Does any family see the future on this device? Perturb the tokens after position p, compare.

    python3 bench/causality_check.py [--sizes deepseek-v3-3b,nemotron-h-1b] [--compile]
    python3 bench/causality_check.py --sizes 1b-bench --compile --fp8 row   # FP8 GEMMs

For each registry size: the model (bf16 on a GPU, fp32 on the CPU), a batch of random
tokens and a copy whose tokens from position ``p = seq / 2`` on are redrawn. A causal model
gives the same logits before ``p`` for both, up to the kernels' nondeterminism: the line
prints the largest difference before ``p`` next to the largest after it (which must be
large). With ``--compile`` the forward runs under ``torch.compile``, as training does.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist

from mega_models import spec_for, stage_spec
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_tp_layers import Fp8Recipe

DEFAULT = "1b-bench,deepseek-v3-3b,qwen3-1.7b,nemotron-h-1b,hybrid-1b,moe-2b"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default=DEFAULT)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--fp8", default="", choices=["", "tensor", "row", "block"],
                    help="FP8 GEMMs with this scaling")  # fmt: skip
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    groups = init_process_groups(ParallelConfig())
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    half = a.seq // 2
    for size in a.sizes.split(","):
        spec = spec_for(size)
        config = spec.sizes[size]
        options = {"fp8": Fp8Recipe(scaling=a.fp8)} if a.fp8 else {}
        model = spec.build(
            config, groups, stage_spec(config.num_layers), device=device, dtype=dtype, **options
        ).eval()
        run = torch.compile(model) if a.compile else model
        gen = torch.Generator().manual_seed(0)
        x = torch.randint(0, config.vocab_size, (2, a.seq), generator=gen)
        y = x.clone()
        y[:, half:] = torch.randint(0, config.vocab_size, (2, a.seq - half), generator=gen)
        with torch.no_grad():
            lx, ly = run(x.to(device)).float(), run(y.to(device)).float()
        before = (lx[:, :half] - ly[:, :half]).abs().max().item()
        after = (lx[:, half:] - ly[:, half:]).abs().max().item()
        verdict = "causal" if before <= 1e-3 * max(after, 1e-6) else "LEAKS THE FUTURE"
        print(f"{size:<16} max |diff| before {half}: {before:.3e}   after: {after:.3e}   {verdict}")
        del model, run
        if cuda:
            torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
