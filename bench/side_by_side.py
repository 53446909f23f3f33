"""One table from a benchmark call's $OUT: every system against mega, MFU against the ceiling.

    python3 bench/side_by_side.py [DIR]        # DIR (default $OUT) holds results.jsonl, ceiling.json

Reads the JSON lines that bench/mega_step.py and the anchors' scripts (torch_ref.py,
bench/peers/mcore.py) append to ``results.jsonl`` and the matmul ceiling that bench/peers/ceiling.py
writes. Per GPU: tokens/s, step ms (median), peak GiB allocated, MFU against the measured
ceiling and against the 989 TFLOP/s datasheet figure, and each line's ratio to mega's line
of the same compile mode and world size.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

DATASHEET_TFLOPS = 989.0


def name(r: dict[str, Any]) -> str:
    system = str(r["system"])
    if system == "megatron-core":
        extra = "sdpa" if r.get("attn") == "sdpa" else "as shipped"
        return f"megatron-core ({extra}{', fused AdamW' if r.get('fused_adam') else ''})"
    mode = {True: "compile", False: "eager"}.get(r.get("compile"), "")
    if system.startswith("mega-"):
        system, mode = "mega", system.removeprefix("mega-")
    if r.get("precision") == "bf16":
        mode += " bf16+fp32 master"
    if r.get("size", "1b-bench") != "1b-bench":
        mode += f" {r['size']}"
    if int(r.get("accum", 1)) > 1:
        mode += f" x{r['accum']} micro-batches"
    layout = "".join(f" {k}{r[k]}" for k in ("tp", "pp", "dp") if int(r.get(k, 1)) > 1)
    return f"{system} {mode}{layout}".strip()


def main(folder: str) -> None:
    ceiling = 0.0
    path = os.path.join(folder, "ceiling.json")
    if os.path.exists(path):
        with open(path) as f:
            ceiling = float(json.load(f)["tflops_median"])
    with open(os.path.join(folder, "results.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if "tokens_per_s" in r]  # step benchmarks only (not fp8_linear's)
    per_gpu = {id(r): r.get("tokens_per_s_per_gpu", r["tokens_per_s"]) for r in rows}
    mega = {
        (r["system"], r.get("world", 1), r.get("size", "1b-bench")): per_gpu[id(r)]
        for r in rows
        if str(r["system"]).startswith("mega-")
    }
    if ceiling:
        print(f"bf16 matmul ceiling: {ceiling:.1f} TFLOP/s (8192^3, median)")
    else:  # a suite without the ceiling line: its column says so instead of "MFU (0)"
        print("bf16 matmul ceiling: not measured in this call (no ceiling.json)")
    against = f"{ceiling:.0f}" if ceiling else "ceiling"
    print(
        f"| system | GPUs | mb | tokens/s/GPU | step ms | peak GiB | MFU ({against}) | MFU (989) | vs mega |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        tps, world = per_gpu[id(r)], r.get("world", 1)
        tflops = tps * r["flops_per_token"] / 1e12
        compiled = r.get("compile") is True or str(r["system"]).startswith("mega-compile")
        size = r.get("size", "1b-bench")  # the peers run 1b-bench's shape
        ref = mega.get(("mega-compile" if compiled else "mega-eager", world, size))
        ratio = f"{tps / ref:.3f}x" if ref else "-"
        mfu = f"{tflops / ceiling:.1%}" if ceiling else "-"
        print(
            f"| {name(r)} | {world} | {r['mb']} | {tps:,.0f} | {r['step_ms_median']:.1f} "
            f"| {r.get('peak_alloc_gib', 0.0):.1f} | {mfu} | {tflops / DATASHEET_TFLOPS:.1%} | {ratio} |"
        )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))
