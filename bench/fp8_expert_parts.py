"""The FP8 experts with one part swapped: ``bench/mega_step.py`` with a variant patched in.

    python3 bench/fp8_expert_parts.py --part row-kernel --size deepseek-v3-3b --mb 4 \\
        --accum 8 --compile --set model.moe_expert_fp8=true   # one GPU

``--part row-kernel``: the experts' activation and output-gradient rows are quantised by
``mega_moe.fp8_rows.quantize_rows_2d``'s one-pass Triton kernel, an operator the compiler
cannot fuse into the producers, instead of the torch expression Inductor fuses into them
(as two-pass loops over rows wider than 1,024 columns: 0.27-0.40 ms a call on an H200,
2026-12-07). Other arguments go to ``bench/mega_step.py``; the result is tagged with the part.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from mega_moe import _fp8_grouped
from mega_moe.fp8_rows import quantize_rows_2d

if __name__ == "__main__":
    part = sys.argv[sys.argv.index("--part") + 1]
    rest = [
        a for i, a in enumerate(sys.argv[1:], 1) if a != "--part" and sys.argv[i - 1] != "--part"
    ]
    if part != "row-kernel":
        raise SystemExit(f"--part {part!r}: use row-kernel")
    _fp8_grouped.quantize_rows = quantize_rows_2d  # type: ignore[assignment]  # looked up per call
    sys.path.insert(0, str(Path(__file__).parent))
    import mega_step

    sys.argv = [sys.argv[0], *rest, "--tag", part]
    torch.manual_seed(0)
    mega_step.main()
