"""``bench/mega_step.py`` with the routing as it was before the twentieth session.

    python3 bench/routing_parts.py --part sorts --size deepseek-v3-3b --mb 4 --accum 8 \\
        --compile   # one GPU

``--part sorts``: ``torch.topk`` for every routing selection (instead of ``row_topk``'s rounds
of max under compile) and the dropless permutation by two stable sorts (instead of
``_permute._counting_order``'s scans): the step-level A/B of the routing without sorts.
Other arguments go to ``bench/mega_step.py``; the result is tagged with the part.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import Tensor

from mega_moe import _permute, scores


def _topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    top = torch.topk(x, k, dim=-1)
    return top.values, top.indices


def _sorted_order(routing_map: Tensor, k: int, counts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    chosen = torch.argsort((~routing_map).to(torch.uint8), dim=1, stable=True)[:, :k]
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return flat, order, inverse


if __name__ == "__main__":
    if "--part" not in sys.argv[:-1] or sys.argv[sys.argv.index("--part") + 1] != "sorts":
        raise SystemExit("give --part sorts")
    at = sys.argv.index("--part")
    scores.row_topk = _topk  # type: ignore[assignment]  # looked up per call
    _permute._counting_order = _sorted_order  # looked up per call
    sys.path.insert(0, str(Path(__file__).parent))
    import mega_step

    sys.argv = [sys.argv[0], *sys.argv[1:at], *sys.argv[at + 2 :], "--tag", "sorts"]
    torch.manual_seed(0)
    mega_step.main()
