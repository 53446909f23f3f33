# mypy: ignore-errors
"""Autotune candidates per kernel: a few for the H200, one under the Triton interpreter
(which cannot time anything, and runs one program after another: small tiles test more)."""

import triton
from triton import knobs

#: kernel -> (block sizes, num_warps) tried on the GPU; the first is the interpreter's alone.
#: Both kernels are memory-bound elementwise work with short reductions: wide channel blocks
#: (the contiguous dim) for coalesced loads, few positions / rows per program.
_CANDIDATES = {
    # causal conv: positions S x channels C per program
    "conv_fwd": [({"BLOCK_S": 16, "BLOCK_C": 16}, 1), ({"BLOCK_S": 32, "BLOCK_C": 128}, 4),
                 ({"BLOCK_S": 64, "BLOCK_C": 64}, 4), ({"BLOCK_S": 16, "BLOCK_C": 256}, 4),
                 ({"BLOCK_S": 64, "BLOCK_C": 128}, 8)],
    # the backward's two passes: dpre with the weight sums (K tap tiles and K accumulators
    # live), then dx from dpre (K tap tiles); the H200 chose 8x128 and 8x256 at 4 warps
    "conv_dpre": [({"BLOCK_S": 16, "BLOCK_C": 16}, 1), ({"BLOCK_S": 8, "BLOCK_C": 128}, 4),
                  ({"BLOCK_S": 16, "BLOCK_C": 64}, 4), ({"BLOCK_S": 16, "BLOCK_C": 128}, 8),
                  ({"BLOCK_S": 4, "BLOCK_C": 256}, 4), ({"BLOCK_S": 32, "BLOCK_C": 64}, 8)],
    "conv_dx": [({"BLOCK_S": 16, "BLOCK_C": 16}, 1), ({"BLOCK_S": 16, "BLOCK_C": 128}, 4),
                ({"BLOCK_S": 32, "BLOCK_C": 128}, 8), ({"BLOCK_S": 8, "BLOCK_C": 256}, 4),
                ({"BLOCK_S": 64, "BLOCK_C": 64}, 8)],
    # gated norm: R rows of one group per program (a row is the group's whole width)
    "norm_fwd": [({"BLOCK_R": 4}, 1), ({"BLOCK_R": 1}, 4), ({"BLOCK_R": 2}, 4),
                 ({"BLOCK_R": 4}, 8), ({"BLOCK_R": 8}, 8)],
    # (8 rows at 8 warps spilled 272 bytes per thread in ptxas -v for sm_90a)
    "norm_bwd": [({"BLOCK_R": 4}, 1), ({"BLOCK_R": 1}, 4), ({"BLOCK_R": 2}, 4),
                 ({"BLOCK_R": 2}, 8), ({"BLOCK_R": 4}, 8)],
}  # fmt: skip


def configs(kernel):
    """The autotune configs of ``kernel``."""
    every = _CANDIDATES[kernel]
    chosen = every[:1] if knobs.runtime.interpret else every[1:]
    return [triton.Config(kw, num_warps=w) for kw, w in chosen]
