"""What splitting the backward costs on one GPU: fused B+W against B, then W from the store.

    python3 bench/split_backward.py --size 1b-bench --mb 8            # eager, bf16
    python3 bench/split_backward.py --size 1b-bench --mb 8 --compile  # train.compile
    python3 bench/split_backward.py --smoke                           # CPU, tiny, fp32

Builds the trainer's model (mega_pretrain.build: GPTModel, bf16 parameters, DDP with fp32
main grads; with ``--compile`` each layer and the head compiled as ``train.compile`` does)
and times, on the same random micro-batch, forward + backward two ways, in alternating
rounds so that drift hits both alike:

- fused: ``loss.backward()`` computes input and weight gradients together;
- split: the forward inside ``mega_tp_layers.defer_weight_grads()``, ``loss.backward()``
  (B: input gradients only), then ``store.run()`` (W: every deferred weight gradient).

No optimizer step, no pipeline: this is the cost of the split itself, which a zero-bubble
schedule pays to move W into its bubbles (issue 23: it must stay within a few percent).
Reports tokens/s of each, the ratio split/fused, the split's B and W times, each mode's
peak memory (the split holds every output gradient its W needs until ``store.run()``),
the number of deferred passes, and under ``--compile`` dynamo's graph breaks (the split's autograd
Functions queue the W pass from their backward, a side effect dynamo runs eagerly).
Appends one JSON line to $OUT/results.jsonl (no ``tokens_per_s`` key, so
``bench/side_by_side.py`` leaves it out of its table) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from itertools import pairwise

import torch
import torch.distributed as dist
from torch import Tensor

from mega_parallel_grid import init_process_groups
from mega_pretrain.build import build
from mega_pretrain.config import load_config
from mega_pretrain.plan import plan_for
from mega_pretrain.runtime import collective_timeout, start_distributed
from mega_tp_layers import defer_weight_grads


class _Clock:
    """Elapsed milliseconds between marks: CUDA events on a GPU, the host clock elsewhere."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[object] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        """Milliseconds between consecutive marks (waits for the GPU)."""
        if self.cuda:
            self.marks[-1].synchronize()  # type: ignore[attr-defined]
            return [a.elapsed_time(b) for a, b in pairwise(self.marks)]  # type: ignore[attr-defined]
        return [1e3 * (b - a) for a, b in pairwise(self.marks)]  # type: ignore[operator]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1b-bench")
    ap.add_argument("--mb", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (one of each mode)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.size, args.mb, args.seq, args.rounds, args.warmup = "tiny", 2, 64, 2, 1
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    start_distributed(device, collective_timeout(10))
    precision = "bf16" if cuda else "fp32"
    overrides = [
        ("model.size", args.size), ("train.seq_len", str(args.seq)),
        ("train.micro_batch_size", str(args.mb)), ("train.global_batch_size", str(args.mb)),
        ("train.precision", precision), ("train.compile", str(args.compile).lower()),
    ]  # fmt: skip
    config = load_config(None, overrides)
    plan = plan_for(config, dist.get_world_size())
    config = replace(config, train=replace(config.train, global_batch_size=args.mb * plan.dp))
    if args.compile:  # the fused and the split forward are two variants of every layer
        cfg = torch._dynamo.config
        limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        setattr(cfg, limit, max(getattr(cfg, limit), 64))
    groups = init_process_groups(plan.parallel)
    built = build(config, groups, device)
    model, ddps = built.chunks[0], built.ddps
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, plan.model.vocab_size, (args.mb, args.seq + 1), generator=gen)
    ids, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def loss() -> Tensor:
        out: Tensor = model(ids, labels)
        return out.float().mean()

    peaks = {"fused": 0.0, "split": 0.0}  # GiB allocated at most in one step of each

    def step(split: bool, clock: _Clock) -> int:
        """One forward + backward; marks: start, after forward, after B, after W."""
        for ddp in ddps:
            ddp.zero_grad_buffer()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        clock.mark()
        if split:
            with defer_weight_grads() as store:
                value = loss()
        else:
            value = loss()
        clock.mark()
        value.backward()
        clock.mark()
        deferred = 0
        if split:
            deferred = len(store)
            store.run()
        clock.mark()
        for ddp in ddps:
            ddp.finish_grad_sync()
        if cuda:
            name = "split" if split else "fused"
            peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device) / 2**30)
        return deferred

    modes: dict[str, Callable[[_Clock], int]] = {
        "fused": lambda c: step(False, c),
        "split": lambda c: step(True, c),
    }
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        for run in modes.values():
            run(_Clock(cuda))
    warmup_s = time.perf_counter() - t0
    spans: dict[str, list[list[float]]] = {name: [] for name in modes}
    deferred = 0
    for _ in range(args.rounds):
        for name, run in modes.items():
            clock = _Clock(cuda)
            deferred = max(deferred, run(clock))
            spans[name].append(clock.spans())  # [forward, B (or B+W), W]
    med = {
        name: [statistics.median(s[i] for s in rows) for i in range(3)]
        for name, rows in spans.items()
    }
    total = {name: statistics.median(sum(s) for s in rows) for name, rows in spans.items()}
    n_tokens = args.mb * args.seq
    breaks = 0
    if args.compile:
        from torch._dynamo.utils import counters

        breaks = sum(counters["graph_break"].values())
    result = {
        "bench": "split_backward", "system": f"mega{'-compile' if args.compile else '-eager'}",
        "size": args.size, "mb": args.mb, "seq": args.seq, "precision": precision,
        "fused_tokens_per_s": n_tokens / (total["fused"] / 1e3),
        "split_tokens_per_s": n_tokens / (total["split"] / 1e3),
        "split_over_fused_time": total["split"] / total["fused"],
        "fused_ms": total["fused"], "split_ms": total["split"],
        "fused_forward_ms": med["fused"][0], "fused_backward_ms": med["fused"][1],
        "split_forward_ms": med["split"][0], "split_b_ms": med["split"][1],
        "split_w_ms": med["split"][2], "deferred_passes": deferred, "graph_breaks": breaks,
        "rounds": args.rounds, "warmup_s": warmup_s,
        "fused_peak_gib": peaks["fused"], "split_peak_gib": peaks["split"],
        "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
    }  # fmt: skip
    line = json.dumps(result, sort_keys=True)
    print("RESULT " + line, flush=True)
    print(
        f"{result['system']} {args.size} mb {args.mb}: fused {result['fused_tokens_per_s']:,.0f} "
        f"tokens/s ({total['fused']:.1f} ms), split B+W {result['split_tokens_per_s']:,.0f} "
        f"tokens/s ({total['split']:.1f} ms = F {med['split'][0]:.1f} + B {med['split'][1]:.1f} "
        f"+ W {med['split'][2]:.1f}), split/fused time {result['split_over_fused_time']:.4f}",
        flush=True,
    )
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "results.jsonl"), "a") as f:
            f.write(line + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
