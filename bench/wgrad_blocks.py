"""``bench/mega_step.py`` with the experts' weight-gradient kernel at other blocks.

    python3 bench/wgrad_blocks.py --blocks 32,128,128,8,4,1 --size deepseek-v3-3b --mb 4 \\
        --accum 8 --compile   # one GPU

``--blocks BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages,PREFETCH`` replaces
``mega_moe._wgrad_triton.BLOCKS`` (read at each call) for the run: the step-level A/B of a
configuration that ``bench/expert_wgrad.py`` timed alone. ``--blocks best`` takes the
configuration with the least fc1 + fc2 time in ``$OUT/expert_wgrad.json`` (that script's
output earlier in the same device call), so one call can time the kernels and then the step.
Other arguments go to ``bench/mega_step.py``; the result is tagged with the blocks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from mega_moe import _wgrad_triton


def parse_blocks(text: str) -> tuple[int, int, int, int, int, bool]:
    """``"32,128,128,8,4,1"`` -> ``(32, 128, 128, 8, 4, True)``; one sentence when malformed."""
    parts = text.split(",")
    if len(parts) != 6 or not all(p.strip().isdigit() for p in parts):
        raise SystemExit(
            f"--blocks {text!r}: give six integers, BLOCK_M,BLOCK_N,BLOCK_K,warps,stages,prefetch"
        )
    m, n, k, warps, stages, prefetch = (int(p) for p in parts)
    return m, n, k, warps, stages, bool(prefetch)


def best_blocks(rows: list[dict[str, object]]) -> tuple[int, int, int, int, int, bool]:
    """The configuration of ``bench/expert_wgrad.py``'s rows with the least summed time over
    the GEMMs it timed (every GEMM must have timed it); one sentence when there is none."""
    times: dict[tuple[int, ...], dict[str, float]] = {}
    for row in rows:
        blocks, ms = row.get("blocks"), row.get("ms")
        if isinstance(blocks, list) and isinstance(ms, int | float) and ms == ms:  # not NaN
            times.setdefault(tuple(int(b) for b in blocks), {})[str(row["gemm"])] = float(ms)
    gemms = {str(row["gemm"]) for row in rows}
    whole = {blocks: sum(t.values()) for blocks, t in times.items() if set(t) == gemms}
    if not whole:
        raise SystemExit("--blocks best: expert_wgrad.json times no configuration on every GEMM")
    m, n, k, warps, stages, prefetch = min(whole, key=lambda b: whole[b])
    return m, n, k, warps, stages, bool(prefetch)


def _chosen(text: str) -> tuple[int, int, int, int, int, bool]:
    if text != "best":
        return parse_blocks(text)
    found = Path(os.environ.get("OUT", "/tmp/bench_out")) / "expert_wgrad.json"
    if not found.exists():
        raise SystemExit(f"--blocks best: {found} is missing; run bench/expert_wgrad.py first")
    blocks = best_blocks(json.loads(found.read_text()))
    print(f"wgrad_blocks: the fastest timed configuration is {blocks}", flush=True)
    return blocks


if __name__ == "__main__":
    if "--blocks" not in sys.argv[:-1]:
        raise SystemExit("give --blocks BLOCK_M,BLOCK_N,BLOCK_K,warps,stages,prefetch")
    at = sys.argv.index("--blocks")
    blocks = _chosen(sys.argv[at + 1])
    _wgrad_triton.BLOCKS = blocks
    sys.path.insert(0, str(Path(__file__).parent))
    import mega_step

    rest = sys.argv[1:at] + sys.argv[at + 2 :]
    sys.argv = [sys.argv[0], *rest, "--tag", "wgrad-" + "-".join(str(int(b)) for b in blocks)]
    torch.manual_seed(0)
    mega_step.main()
