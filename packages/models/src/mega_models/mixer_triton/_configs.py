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
    # its backward recomputes K shifted pre-activations per tile (K^2 loads live at once):
    # 8 elements per thread; 16 reached ptxas -v's 255 registers for sm_90a (64x64 spilled)
    "conv_bwd": [({"BLOCK_S": 16, "BLOCK_C": 16}, 1), ({"BLOCK_S": 16, "BLOCK_C": 64}, 4),
                 ({"BLOCK_S": 8, "BLOCK_C": 128}, 4), ({"BLOCK_S": 16, "BLOCK_C": 128}, 8),
                 ({"BLOCK_S": 32, "BLOCK_C": 64}, 8)],
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
