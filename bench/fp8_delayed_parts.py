"""Where delayed FP8 scaling's time goes: ``bench/mega_step.py`` with parts of it switched off.

    python3 bench/fp8_delayed_parts.py --part no-record --size 1b-bench --mb 8 --compile --fp8 \\
        --set train.fp8_amax_history=16   # one GPU

``--part no-record``: the forward records no ``|x|`` max (each layer's history keeps its
cold step's input amax), so the input's cast has no reduction beside it. ``--part
no-probe``: the backward records no ``|dy|`` max either (no probe). The
losses stay meaningful for a few steps only; the step time says what the recording costs
against the fixed-scale bound (``bench/fp8_fixed_scale.py``). Other arguments go to
``bench/mega_step.py``; the result is tagged with the part. ``--part rows-amax``: current
scaling (no history) with its amaxes reduced over rows first (``recorded_amax``; measured
slower than the whole-tensor max, 2026-12-06). ``--part opaque-amax``: current scaling with
its amaxes taken by an opaque reduction (``opaque_amax``). ``--part opaque-record``: delayed
scaling recording through that opaque reduction (its default from 2026-12-06 until it
measured 3 % slower than the fusable form on 2026-12-07). ``--part opaque-transpose``: the
weight-gradient GEMMs' transposed fp8 copies made by ``mega_tp_layers.fp8_transpose``'s
tiled kernel, an operator the compiler cannot fuse into the casting kernels (any scaling).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

import mega_tp_layers.column_parallel as column_parallel
import mega_tp_layers.fp8 as fp8
import mega_tp_layers.fp8_delayed as delayed
import mega_tp_layers.fp8_gemm as fp8_gemm
import mega_tp_layers.fp8_transpose as fp8_transpose


def _no_record(self: delayed.Fp8AmaxHistory, x: Tensor) -> delayed.Fp8Delayed:
    if not self.warm:  # the cold step records, so the history has a scale to use
        return _record(self, x)
    return delayed.Fp8Delayed(self.history.amax(dim=0), self.probe)


def _no_probe(self: delayed.Fp8AmaxHistory, x: Tensor) -> delayed.Fp8Delayed:
    if not self.warm:
        return _record(self, x)
    # no probe: the linear's backward computes no |dy| max (the scales stay the cold step's)
    return delayed.Fp8Delayed(self.history.amax(dim=0), None)


_record = delayed.Fp8AmaxHistory.for_forward


def _quantize_by(amax_of: Callable[[Tensor], Tensor]) -> Callable[..., fp8.Fp8Tensor]:
    """Current scaling with the amax taken by ``amax_of`` (``recorded_amax``: rows first, in ops
    the compiler fuses into the producer; ``opaque_amax``: an opaque reduction kernel)."""

    def quantize(
        x: Tensor, dtype: torch.dtype, eps: float = 1e-12, group: ProcessGroup | None = None
    ) -> fp8.Fp8Tensor:
        amax = amax_of(x)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(amax, dist.ReduceOp.MAX, group=group)
        return fp8.fp8_quantize_by_amax(x.detach().float(), amax, dtype, eps)

    return quantize


if __name__ == "__main__":
    part = sys.argv[sys.argv.index("--part") + 1]
    rest = [
        a for i, a in enumerate(sys.argv[1:], 1) if a != "--part" and sys.argv[i - 1] != "--part"
    ]
    parts = (
        "no-record",
        "no-probe",
        "rows-amax",
        "opaque-amax",
        "opaque-record",
        "opaque-transpose",
    )
    if part not in parts:
        raise SystemExit(f"--part {part!r}: use one of {', '.join(parts)}")
    if part == "rows-amax":  # looked up at call time, as bench/fp8_fixed_scale.py does
        fp8.fp8_quantize = _quantize_by(delayed.recorded_amax)
    elif part == "opaque-amax":
        fp8.fp8_quantize = _quantize_by(delayed.opaque_amax)
    elif part == "opaque-transpose":  # looked up by scaled_gemm at call time
        fp8_gemm.row_major = fp8_transpose.row_major_by_kernel
        fp8_gemm.col_major = fp8_transpose.col_major_by_kernel
    elif part == "opaque-record":  # delayed scaling recording as it did 2026-12-06 … 07
        for module in (fp8, column_parallel, delayed):
            module.recorded_amax = delayed.opaque_amax  # type: ignore[attr-defined]
    else:
        patch = _no_record if part == "no-record" else _no_probe
        delayed.Fp8AmaxHistory.for_forward = patch  # type: ignore[method-assign]
    sys.path.insert(0, str(Path(__file__).parent))
    import mega_step

    sys.argv = [sys.argv[0], *rest, "--tag", part]
    torch.manual_seed(0)
    mega_step.main()
