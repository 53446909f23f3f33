"""The bf16 matmul ceiling of this GPU: ``torch.matmul`` at 8192³, median of 20 timed runs.

    python3 bench/peers/ceiling.py [--n 8192]

Three input pairs rotate (so no run reuses a cached operand), 10 warm-up runs. Writes
``$OUT/ceiling.json`` (``tflops_median``, ``tflops_best``) for bench/side_by_side.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from _common import out_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    n = ap.parse_args().n
    iters = ap.parse_args().iters
    if not torch.cuda.is_available():
        raise SystemExit("ceiling.py measures a GPU; no CUDA device is visible")
    pairs = [
        (torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
         torch.randn(n, n, device="cuda", dtype=torch.bfloat16))
        for _ in range(3)
    ]  # fmt: skip
    for i in range(10):
        torch.matmul(*pairs[i % 3])
    ms = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(*pairs[i % 3])
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end))
    flop = 2.0 * n**3
    result = {
        "n": n, "ms_median": statistics.median(ms),
        "tflops_median": flop / (statistics.median(ms) / 1e3) / 1e12,
        "tflops_best": flop / (min(ms) / 1e3) / 1e12, "device": torch.cuda.get_device_name(),
    }  # fmt: skip
    print(json.dumps(result))
    with open(os.path.join(out_dir(), "ceiling.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
