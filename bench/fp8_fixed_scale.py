"""What delayed FP8 scaling could gain at most: ``bench/mega_step.py`` with fixed scales.

    python3 bench/fp8_fixed_scale.py --size 1b-bench --mb 8 --compile --fp8   # one GPU

Tensor-wise FP8 today scales each operand by its current amax, a reduction over the whole
tensor that must finish before the cast, so under ``torch.compile`` the cast cannot fuse
into the kernel that produces the tensor (the RMSNorm, the SwiGLU): quantisation took ~33 ms
of `1b-bench`'s FP8 step on the H200 (2026-12-02). Delayed scaling takes the scale from
earlier steps' amaxes instead. This script runs the same step with every tensor-wise scale
fixed (amax taken as the format's largest value: no reduction at all, so the cast is a
pointwise op Inductor may fuse into its producer) and tags the result ``fixed-scale``. The
losses are meaningless; the step time is an upper bound on delayed scaling's gain (which
still records each amax, a reduction fused into the same kernels). All arguments go to
``bench/mega_step.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.distributed import ProcessGroup

import mega_tp_layers.fp8 as fp8


def _fixed(
    x: torch.Tensor, dtype: torch.dtype, eps: float = 1e-12, group: ProcessGroup | None = None
) -> fp8.Fp8Tensor:
    amax = torch.full((), torch.finfo(dtype).max, device=x.device)
    return fp8.fp8_quantize_by_amax(x, amax, dtype, eps)


if __name__ == "__main__":
    # looked up at call time by _Fp8Linear and shared_grad; a function of this (real)
    # __main__ module, so that Dynamo's guards on it resolve
    fp8.fp8_quantize = _fixed
    sys.path.insert(0, str(Path(__file__).parent))
    import mega_step

    sys.argv = [sys.argv[0], *sys.argv[1:], "--tag", "fixed-scale"]
    mega_step.main()
