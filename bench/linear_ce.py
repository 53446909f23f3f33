"""Today's LM head against the fused linear + cross-entropy: peak memory and fwd+bwd time.

    python3 bench/linear_ce.py                 # H200: 16k tokens, hidden 2048, vocab 32k and 128k
    python3 bench/linear_ce.py --compile       # both under torch.compile (as train.compile does)
    python3 bench/linear_ce.py --smoke         # CPU, tiny shapes: the script runs

Both variants are ``mega_models.lm_head`` itself (norm left out, a tied ``[V, h]`` bf16
weight, ``[s, b] = [2048, 8]`` tokens, mean loss backward): ``loss_chunk_size 0`` (the
projection's bf16 logits, then the fp32 cross-entropy) and ``loss_chunk_size N`` for each
``--chunks`` value (``train.loss_chunk_size``). Per case: mean ms of forward + backward
over ``--iters`` timed runs (``torch.utils.benchmark``) after ``--warmup``; ``peak_gib``,
the largest allocation above what the inputs and their gradients hold; head tokens/s;
TFLOP/s counted as the unfused head's 3 GEMMs (6·T·h·V; the fused one runs 4); and the
fused result's difference from the unfused one (loss relative, and each gradient's max
|diff| / max |ref|: bf16 rounding, where the fused head keeps fp32 logits). A case that
runs out of memory is reported as such. One JSON line per case to $OUT/results.jsonl, a
table last.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.benchmark as benchmark
from torch import Tensor, nn

from mega_models import lm_head

Head = Callable[..., Tensor]


def _time(fn: Callable[[], None], warmup: int, iters: int) -> float:
    """Mean milliseconds of ``fn`` over ``iters`` runs (torch.utils.benchmark synchronises)."""
    for _ in range(warmup):
        fn()
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn})
    return float(timer.timeit(iters).median) * 1e3


def _run(head: Head, x: Tensor, w: Tensor, labels: Tensor, group: Any) -> tuple[Tensor, ...]:
    """One forward + backward of the head on fresh gradients: (loss, dx, dw)."""
    x.grad = w.grad = None
    loss = head(
        x, labels, final_norm=nn.Identity(), output=None, tied_weight=w, tp_group=group,
        sequence_parallel=False, vocab_size=w.shape[0],
    ).mean()  # fmt: skip
    loss.backward()
    assert x.grad is not None and w.grad is not None
    return loss.detach(), x.grad, w.grad


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def _case(
    head: Head, x: Tensor, w: Tensor, labels: Tensor, group: Any, args: argparse.Namespace
) -> dict[str, Any]:
    cuda = x.is_cuda
    try:
        result = _run(head, x, w, labels, group)  # compiles, if compiled
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        del result
        result = _run(head, x, w, labels, group)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else 0.0

        def step() -> None:
            _run(head, x, w, labels, group)

        ms = _time(step, args.warmup, args.iters)
    except torch.OutOfMemoryError:
        return {"oom": True}
    return {"ms": ms, "peak_gib": peak, "result": result}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=8, help="b of [s, b]; s = tokens / b")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocabs", default="32768,131072")
    ap.add_argument("--chunks", default="2048,4096,8192", help="loss_chunk_size values")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="torch.compile each head")
    ap.add_argument("--smoke", action="store_true", help="CPU-sized shapes, a few iterations")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.batch, args.hidden, args.vocabs = 96, 2, 32, "100,300"
        args.chunks, args.iters, args.warmup = "16,40", 2, 1
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    seq = args.tokens // args.batch
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for vocab in map(int, args.vocabs.split(",")):
        x = torch.randn(seq, args.batch, args.hidden, device=device, dtype=dtype, generator=gen)
        x.requires_grad_()
        w = 0.02 * torch.randn(vocab, args.hidden, device=device, dtype=dtype, generator=gen)
        w.requires_grad_()
        labels = torch.randint(0, vocab, (args.batch, seq), device=device, generator=gen)
        heads: dict[int, Head] = {0: lm_head}
        for chunk in map(int, args.chunks.split(",")):
            heads[chunk] = lambda *a, chunk=chunk, **k: lm_head(*a, loss_chunk_size=chunk, **k)
        reference: tuple[Tensor, ...] | None = None
        for chunk, head in heads.items():
            fn = torch.compile(head) if args.compile else head
            out = _case(fn, x, w, labels, group, args)
            row: dict[str, Any] = {
                "bench": "linear_ce", "variant": "fused" if chunk else "unfused", "chunk": chunk,
                "vocab": vocab, "tokens": args.tokens, "hidden": args.hidden,
                "dtype": str(dtype).removeprefix("torch."), "compile": args.compile,
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            }  # fmt: skip
            if "result" in out:
                result = out.pop("result")
                flops = 6 * args.tokens * args.hidden * vocab
                row.update(out, head_tokens_per_s=args.tokens / out["ms"] * 1e3,
                           tflops_3gemm=flops / out["ms"] / 1e9)  # fmt: skip
                if reference is None and chunk == 0:
                    reference = result
                elif reference is not None:
                    row["loss_rel"] = abs(float(result[0]) / float(reference[0]) - 1.0)
                    row["dx_rel"], row["dw_rel"] = (
                        _rel(result[1], reference[1]),
                        _rel(result[2], reference[2]),
                    )
                del result
            else:
                row.update(out)
            rows.append(row)
            line = json.dumps(row, sort_keys=True)
            print("RESULT " + line, flush=True)
            if os.environ.get("OUT"):
                with open(os.path.join(os.environ["OUT"], "results.jsonl"), "a") as f:
                    f.write(line + "\n")
            if cuda:
                torch._dynamo.reset()
                torch.cuda.empty_cache()
        del x, w, reference
    mode = "compiled" if args.compile else "eager"
    print(
        f"\n| vocab | head ({mode}) | ms fwd+bwd | peak GiB | tokens/s | TFLOP/s (6ThV) | dw rel |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        label = f"fused, chunk {r['chunk']}" if r["chunk"] else "today's (unfused)"
        if r.get("oom"):
            print(f"| {r['vocab']} | {label} | OOM | | | | |")
            continue
        print(f"| {r['vocab']} | {label} | {r['ms']:.2f} | {r['peak_gib']:.2f} | "
              f"{r['head_tokens_per_s']:,.0f} | {r['tflops_3gemm']:.0f} | "
              f"{r.get('dw_rel', 0.0):.2g} |")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
