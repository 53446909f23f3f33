"""``bench/mega_step.py`` with the experts' weight-gradient kernel at other blocks.

    python3 bench/wgrad_blocks.py --blocks 32,128,128,8,4,1 --size deepseek-v3-3b --mb 4 \\
        --accum 8 --compile   # one GPU

``--blocks BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages,PREFETCH`` replaces
``mega_moe._wgrad_triton.BLOCKS`` (read at each call) for the run: the step-level A/B of a
configuration that ``bench/expert_wgrad.py`` timed alone. Other arguments go to
``bench/mega_step.py``; the result is tagged with the blocks.
"""

from __future__ import annotations

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


if __name__ == "__main__":
    if "--blocks" not in sys.argv[:-1]:
        raise SystemExit("give --blocks BLOCK_M,BLOCK_N,BLOCK_K,warps,stages,prefetch")
    at = sys.argv.index("--blocks")
    blocks = parse_blocks(sys.argv[at + 1])
    _wgrad_triton.BLOCKS = blocks
    sys.path.insert(0, str(Path(__file__).parent))
    import mega_step

    rest = sys.argv[1:at] + sys.argv[at + 2 :]
    sys.argv = [sys.argv[0], *rest, "--tag", "wgrad-" + "-".join(str(int(b)) for b in blocks)]
    torch.manual_seed(0)
    mega_step.main()
