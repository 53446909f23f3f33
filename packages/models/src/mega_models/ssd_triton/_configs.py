# mypy: ignore-errors
"""Autotune candidates per kernel: a few for the H200 (block sizes along the chunk, warps,
pipeline stages), one under the Triton interpreter (which cannot time anything)."""

import triton
from triton import knobs

#: kernel -> (block sizes, num_warps, num_stages) tried on the GPU; the first is the
#: interpreter's alone. Blocks along the chunk stay >= 16 (``tl.dot``'s smallest side).
_CANDIDATES = {
    # chunk state: [p, t] @ [t, n] accumulated over blocks of t steps
    "state": [({"BLOCK_T": 16}, 4, 1), ({"BLOCK_T": 64}, 4, 3), ({"BLOCK_T": 32}, 8, 3),
              ({"BLOCK_T": 128}, 8, 2)],
    # C_i . B_j per group: rows M, columns K (the blocks reaching j <= i, all that is read)
    "scores": [({"BLOCK_M": 16, "BLOCK_K": 16}, 4, 1), ({"BLOCK_M": 64, "BLOCK_K": 64}, 4, 2),
               ({"BLOCK_M": 128, "BLOCK_K": 64}, 8, 2), ({"BLOCK_M": 64, "BLOCK_K": 128}, 8, 2)],
    # chunk scan: output rows M, source steps K
    "scan": [({"BLOCK_M": 16, "BLOCK_K": 16}, 4, 1), ({"BLOCK_M": 64, "BLOCK_K": 64}, 4, 2),
             ({"BLOCK_M": 64, "BLOCK_K": 32}, 4, 3), ({"BLOCK_M": 128, "BLOCK_K": 64}, 8, 2)],
    # input gradients per head over the whole chunk, output rows taken I at a time
    "dx": [({"BLOCK_I": 16}, 4, 1), ({"BLOCK_I": 32}, 8, 2), ({"BLOCK_I": 64}, 8, 2),
           ({"BLOCK_I": 32}, 8, 3)],
    # B and C gradients per group: rows M, the other side K
    # (a program loops over the group's heads inside each block of K: small row blocks, more
    # programs; 8 warps, as at 4 the former heads-outside loop spilled 350-1,000 bytes per
    # thread in ptxas -v for sm_90a)
    "dbc": [({"BLOCK_M": 16, "BLOCK_K": 16}, 4, 1), ({"BLOCK_M": 32, "BLOCK_K": 32}, 8, 2),
            ({"BLOCK_M": 32, "BLOCK_K": 64}, 8, 2), ({"BLOCK_M": 64, "BLOCK_K": 32}, 8, 1),
            ({"BLOCK_M": 64, "BLOCK_K": 64}, 8, 2)],
}  # fmt: skip


def configs(kernel):
    """The autotune configs of ``kernel``."""
    every = _CANDIDATES[kernel]
    chosen = every[:1] if knobs.runtime.interpret else every[1:]
    return [triton.Config(kw, num_warps=w, num_stages=s) for kw, w, s in chosen]
