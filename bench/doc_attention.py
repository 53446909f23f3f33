"""Packed-document attention (mega_models.doc_mask) vs plain causal SDPA: forward + backward ms.

On the GPU machine, from the repository root (bf16):

    export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
    python3 bench/doc_attention.py

Here (CPU, tiny sizes; only checks that the script runs, the flex case forward only since
FlexAttention has no CPU backward):

    uv run python bench/doc_attention.py --smoke

Shape: 1b-bench's attention, b 8, s 2048, 16 heads (MHA), head dim 128, documents of
~300 tokens (lengths drawn uniformly from 150..450, the last one cut by the sample's end).
Cases, each timed as warm-up then the median of ``--iters`` runs (CUDA events on a GPU):

- ``causal``: ``F.scaled_dot_product_attention(is_causal=True)``, what mega runs without
  packing (flash on the GPU);
- ``flex``: the GPU path of ``data.reset_attention_mask``, compiled FlexAttention with the
  document block mask (its creation, once per micro-batch and shared by all layers, timed
  on its own as ``block_mask``);
- ``dense``: SDPA with the boolean ``[b, 1, s, s]`` document mask (the CPU path).

``flex`` output is checked against ``dense`` (max abs error printed). The fraction of the
causal scores a document mask keeps (``kept``) bounds what skipping blocks can gain. With
$OUT set, each row is appended as JSON to $OUT/doc_attention.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mega_models.doc_mask import DocumentMask, document_attention, document_mask


def packed_ids(batch: int, seq: int, doc_len: int, seed: int = 0) -> torch.Tensor:
    """``[b, s]`` document ids of samples packed with documents of ``doc_len / 2 ..
    3 doc_len / 2`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths: list[int] = []
        while sum(lengths) < seq:
            lengths.append(
                int(torch.randint(doc_len // 2, 3 * doc_len // 2 + 1, (1,), generator=gen))
            )
        rows.append(
            torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq]
        )
    return torch.stack(rows)


def timed(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--doc-len", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.seq, args.heads, args.head_dim, args.doc_len = 2, 256, 4, 32, 40
        args.warmup, args.iters = 1, 3
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, s, n, d = args.batch, args.seq, args.heads, args.head_dim
    ids = packed_ids(b, s, args.doc_len).to(device)
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (
        torch.randn(b, n, s, d, device=device, dtype=dtype, generator=gen).requires_grad_()
        for _ in range(3)
    )
    grad = torch.randn(b, n, s, d, device=device, dtype=dtype, generator=gen)
    backward = device.type == "cuda"  # FlexAttention has no CPU backward

    def step(attend: Callable[[], torch.Tensor], with_backward: bool = True) -> Callable[[], None]:
        def run() -> None:
            out = attend()
            if with_backward:
                out.backward(grad)
                q.grad = k.grad = v.grad = None

        return run

    dense = document_mask(ids, backend="sdpa")
    flex_mask: DocumentMask = document_mask(ids, backend="flex")
    kept = float(dense.dense().float().sum()) / (b * s * (s + 1) / 2)

    def case(name: str, fn: Callable[[], object], **extra: object) -> dict[str, object]:
        return {"case": name, "ms": timed(fn, device, args.warmup, args.iters), **extra}

    detached = [t.detach() for t in (q, k, v)]  # the CPU flex case: forward only
    flex_inputs = (q, k, v) if backward else detached
    rows = [
        case("block_mask", lambda: document_mask(ids, backend="flex")),
        case("causal", step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))),
        case(
            "flex",
            step(lambda: document_attention(*flex_inputs, flex_mask), backward),
            backward=backward,
        ),
        case("dense", step(lambda: document_attention(q, k, v, dense))),
    ]
    err = document_attention(*detached, flex_mask) - document_attention(*detached, dense)
    err = err.float().abs()
    shape = {"batch": b, "seq": s, "heads": n, "head_dim": d, "doc_len": args.doc_len}
    print(f"{device.type} {dtype}, {shape}, kept {kept:.3f} of the causal scores, "
          f"flex vs dense max abs error {float(err.max()):.2e}")  # fmt: skip
    causal_ms = float(rows[1]["ms"])  # type: ignore[arg-type]
    for row in rows:
        ms = float(row["ms"])  # type: ignore[arg-type]
        what = "fwd" if row["case"] == "block_mask" or row.get("backward") is False else "fwd+bwd"
        print(f"  {row['case']:<11} {what:<8} {ms:9.3f} ms  {ms / causal_ms:6.2f}x causal")
    out = os.environ.get("OUT")
    if out:
        with (Path(out) / "doc_attention.jsonl").open("a") as f:
            for row in rows:
                f.write(json.dumps({**row, **shape, "device": device.type, "kept": kept}) + "\n")


if __name__ == "__main__":
    main()
