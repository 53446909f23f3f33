"""``bench/mega_step.py`` with MLA's core attention on values zero-padded to the qk head dim
(the path before cuDNN's kernel took the unequal dims): the A/B of ``latent_sdpa``'s
choice in the whole step.

    python3 bench/mla_padded.py --size deepseek-v3-3b --mb 4 --accum 8 --compile   # one GPU

Every argument goes to ``bench/mega_step.py``; the result is tagged ``padded``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import mega_models.mla as mla


def _never(device: torch.device) -> bool:
    return False


if __name__ == "__main__":
    mla.cudnn_takes_narrow_values = _never  # looked up by latent_sdpa at call time
    sys.path.insert(0, str(Path(__file__).parent))
    import mega_step

    sys.argv = [sys.argv[0], *sys.argv[1:], "--tag", "padded"]
    torch.manual_seed(0)
    mega_step.main()
