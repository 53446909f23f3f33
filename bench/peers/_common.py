"""What every peer script shares: the compared shape, its FLOP count, step timing, the record.

The shape is the anchors' (and ``1b-bench``'s): a Llama-style decoder, hidden 2048, 16
heads of 128 (MHA), 24 layers, SwiGLU FFN 5632, RoPE, RMSNorm, sequence 2048, vocabulary
32000, untied embeddings, no biases. Model FLOPs per token follow the Megatron/PaLM
convention: ``6·N + 12·L·h·s`` with ``N`` the parameters that take part in GEMMs (all but
the input embedding table) and the attention products counted full (not causal-halved).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SHAPE", "Shape", "flops_per_token", "out_dir", "record", "time_steps"]


@dataclass(frozen=True)
class Shape:
    hidden: int = 2048
    heads: int = 16
    layers: int = 24
    ffn: int = 5632
    seq: int = 2048
    vocab: int = 32000


SHAPE = Shape()
SMOKE = Shape(hidden=64, heads=4, layers=2, ffn=128, seq=32, vocab=257)


def flops_per_token(shape: Shape) -> float:
    """``6·N + 12·L·h·s`` (see the module doc)."""
    h, f = shape.hidden, shape.ffn
    per_layer = 4 * h * h + 3 * h * f + 2 * h  # q, k, v, o; gate, up, down; two norms
    matmul_params = shape.layers * per_layer + h + shape.vocab * h  # + final norm + head
    return 6.0 * matmul_params + 12.0 * shape.layers * h * shape.seq


def out_dir() -> str:
    folder = os.environ.get("OUT") or "/tmp/bench_out"
    os.makedirs(folder, exist_ok=True)
    return folder


def time_steps(step: Callable[[], Any], warmup: int, iters: int) -> tuple[list[float], Any]:
    """Milliseconds of each of ``iters`` steps after ``warmup`` (CUDA events; wall clock on
    CPU), and the last step's result."""
    last = None
    for _ in range(warmup):
        last = step()
    cuda = torch.cuda.is_available()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            last = step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            last = step()
            times.append(1e3 * (time.perf_counter() - t0))
    return times, last


def record(result: dict[str, Any], times: list[float], tokens_per_step: int, shape: Shape) -> None:
    """Complete ``result`` with the step figures, print it and append it to $OUT/results.jsonl
    (the schema bench/side_by_side.py reads)."""
    cuda = torch.cuda.is_available()
    median = statistics.median(times)
    tok_s = tokens_per_step / (median / 1e3)
    flops = flops_per_token(shape)
    result.update(
        tokens_per_s=tok_s, step_ms_median=median, step_ms_min=min(times),
        step_ms_max=max(times), flops_per_token=flops, model_tflops=tok_s * flops / 1e12,
        peak_alloc_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
        torch=torch.__version__, device=torch.cuda.get_device_name() if cuda else "cpu",
    )  # fmt: skip
    line = json.dumps(result, sort_keys=True)
    print("RESULT " + line, flush=True)
    with open(os.path.join(out_dir(), "results.jsonl"), "a") as f:
        f.write(line + "\n")
