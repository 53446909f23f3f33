"""GPU kernel time of any benchmark script, by kind, per step (torch.profiler, CUDA only).

    python3 bench/kernel_profile.py --steps-run 8 --label mega -- bench/mega_step.py --mb 8 --compile --steps 5 --warmup 3

Runs the script (``runpy``, with its own argv) under the profiler for its whole life,
compile and warm-up included (autotuning's timing runs too), so pass few steps:
``--steps-run`` (warm-up + timed steps) divides the totals. For the steady state alone,
``bench/mega_step.py --profile N`` profiles N steps after its timed ones, with
:func:`summary`. Prints one line per kind (GEMM, attention, Triton/fused, NCCL,
optimizer, copies/casts, other) and the 20 costliest kernels; writes them to
``$OUT/profile_<label>.txt``.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

# first match wins: Inductor's kernels first (their names list the ops they fused, e.g. a
# quantisation kernel feeding a GEMM is ``triton_red_fused__scaled_mm_...``: counted as
# gemm until 2026-12-06), then attention (cuDNN's names carry ``sm90_``) before the GEMMs
KINDS = [
    ("triton", re.compile(r"^triton_", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|nvjet|sm90_|cublas|matmul|_mm_", re.I)),
    ("nccl", re.compile(r"nccl", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|_amp_", re.I)),
    ("triton", re.compile(r"triton", re.I)),
    ("copy/cast", re.compile(r"copy|cast|cat|convert|transpose|memcpy|memset|fill", re.I)),
    ("loss", re.compile(r"softmax|log_softmax|nll|cross_entropy", re.I)),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def summary(prof: profile, steps: int, label: str, cuda: bool = True, top: int = 20) -> str:
    """Kernel time per step by kind, then the ``top`` costliest kernels, of ``steps`` steps."""
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, tuple[float, int]] = {}
    for e in prof.key_averages():
        us = e.device_time_total if cuda else e.self_cpu_time_total
        if us <= 0 or e.key.startswith("ProfilerStep") or e.key.startswith("cuda"):
            continue
        by_kind[kind_of(e.key)] += us
        by_name[e.key] = (us, e.count)
    total = sum(by_kind.values())
    lines = [f"== {label}: GPU kernel time per step {total / steps / 1e3:.1f} ms"]
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:<10} {us / steps / 1e3:8.2f} ms  {us / total:6.1%}")
    lines.append("  top kernels (ms/step, calls/step):")
    for name, (us, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(
            f"  {us / steps / 1e3:8.2f} {count / steps:7.1f}  {kind_of(name):<9} {name[:110]}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps-run", type=int, required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    argv = [x for x in a.args if x != "--"]
    sys.argv = [a.script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(a.script)))  # its sibling modules
    cuda = torch.cuda.is_available()  # CPU: a smoke run of this script, operator times
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        try:
            runpy.run_path(a.script, run_name="__main__")
        except SystemExit:
            pass
    text = summary(prof, a.steps_run, a.label, cuda)
    if os.environ.get("RANK", "0") != "0":  # under torchrun: rank 0 reports
        return
    print(text, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"profile_{a.label}.txt"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
