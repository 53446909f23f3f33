# mypy: ignore-errors
"""The kernel behind :func:`~mega_moe.wgrad_accum.grouped_wgrad_accumulate` on CUDA.

``main[l] += alpha * dy[rows_l]^T @ x[rows_l]`` for every expert ``l`` at once: one program
per (expert, ``BLOCK_N x BLOCK_K`` tile of its weight gradient). It walks the expert's rows
(``ends[l-1] .. ends[l]``) ``BLOCK_M`` at a time, accumulating the tile in fp32 registers,
then reads the fp32 main gradient's tile once, adds and writes it back. The weight gradient
never exists in memory: against a grouped GEMM that writes it in bf16 and a pass that adds
it into ``main`` it saves the bf16 write and read and runs the fp32 read-modify-write
inside the GEMM (where the expert blocks are short, as in fine-grained MoE, that pass costs
as much as the GEMM). An expert with no rows leaves its tiles untouched.

``PREFETCH`` issues the main gradient's load before the loop over the rows, so its ~1 us
latency and its share of the bandwidth overlap the products; without it every program reads
its tile only after its products, and a wave of programs does all its arithmetic and then all
its memory traffic (on an H100 the kernel took about the sum of the two: 0.9-1.08 ms for
``deepseek-3b``'s fc1, where the products alone at the GEMMs' ~600 TFLOP/s take 0.47 ms and
the 1.48 GB of fp32 reads and writes 0.49 ms). It holds the tile in registers through the
loop: 8 warps for a 128 x 128 tile. Not yet timed on a GPU (2026-12-08): :data:`BLOCKS`
keeps it off until ``bench/expert_wgrad.py`` says which configuration wins.

Imported only when called, so the package never needs triton.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["BLOCKS", "TUNING", "grouped_wgrad_accumulate_kernel"]

#: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, PREFETCH): rows per step, the output
#: tile, the launch and whether the main gradient's tile is read before the products; short
#: steps over the rows (an expert sees a few hundred) and 4 warps
BLOCKS = (32, 128, 128, 4, 4, False)


@triton.jit
def _kernel(
    main_ptr, dy_ptr, x_ptr, ends_ptr, n, k, alpha,
    stride_me, stride_mn, stride_dy, stride_x,
    SCALE: tl.constexpr, WIDEN: tl.constexpr, PREFETCH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    expert = tl.program_id(1)
    tiles_k = tl.cdiv(k, BLOCK_K)
    tile_n = tl.program_id(0) // tiles_k
    tile_k = tl.program_id(0) % tiles_k
    end = tl.load(ends_ptr + expert).to(tl.int64)
    start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
    if end > start:
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
        rows = tl.arange(0, BLOCK_M)
        where = (
            main_ptr
            + expert.to(tl.int64) * stride_me
            + offs_n[:, None].to(tl.int64) * stride_mn
            + offs_k[None, :]
        )
        keep = (offs_n[:, None] < n) & (offs_k[None, :] < k)
        if PREFETCH:
            prior = tl.load(where, mask=keep, other=0.0)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for m in range(start, end, BLOCK_M):
            r = m + rows
            inside = r < end
            a = tl.load(
                dy_ptr + r[:, None] * stride_dy + offs_n[None, :],
                mask=inside[:, None] & (offs_n[None, :] < n),
                other=0.0,
            )  # [BLOCK_M, BLOCK_N]
            b = tl.load(
                x_ptr + r[:, None] * stride_x + offs_k[None, :],
                mask=inside[:, None] & (offs_k[None, :] < k),
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            if WIDEN:  # the interpreter's dot misreads bf16 operands: give it fp32 (exact)
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(tl.trans(a), b, acc)
        if SCALE:
            acc = acc * alpha
        if PREFETCH:
            acc += prior
        else:
            acc += tl.load(where, mask=keep, other=0.0)
        tl.store(where, acc, mask=keep)


#: the block configurations ``bench/expert_wgrad.py`` times (H100, 2026-12-06, deepseek-3b's
#: expert shapes: 0.90-1.08 ms for fc1, 0.49-0.58 ms for fc2; :data:`BLOCKS` the fastest of
#: both, within 1 % of what Triton's autotuner picked)
TUNING = [
    (64, 128, 128, 8, 3, False),
    (64, 128, 256, 8, 3, False),
    (64, 256, 128, 8, 3, False),
    (128, 128, 128, 8, 3, False),
    (64, 64, 128, 4, 4, False),
    BLOCKS,
    # the main gradient's tile read before the products (twentieth session, not yet timed)
    (32, 128, 128, 8, 4, True),
    (64, 128, 128, 8, 3, True),
    (32, 128, 128, 4, 4, True),
    (64, 64, 128, 4, 4, True),
    (32, 64, 128, 4, 4, True),
]


def grouped_wgrad_accumulate_kernel(
    main: Tensor, dy: Tensor, x: Tensor, ends: Tensor, alpha: float,
    blocks: tuple[int, int, int, int, int, bool] | None = None,
) -> None:  # fmt: skip
    """``main [L, N, K]`` fp32 (rows contiguous), ``dy [M, N]`` and ``x [M, K]`` (rows
    contiguous, one dtype), ``ends [L]`` int32 on the device: the end row of each expert.

    ``blocks``: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, PREFETCH)``,
    :data:`BLOCKS` if None. No autotuner: it times each candidate on the call's own
    operands, which here means copying the main gradient aside and back (``restore_value``)
    inside a training step."""
    experts, n, k = main.shape
    args = (
        main, dy, x, ends, n, k, float(alpha),
        main.stride(0), main.stride(1), dy.stride(0), x.stride(0),
    )  # fmt: skip
    flags = {"SCALE": alpha != 1.0, "WIDEN": main.device.type == "cpu"}
    block_m, block_n, block_k, warps, stages, prefetch = BLOCKS if blocks is None else blocks
    fixed = (triton.cdiv(n, block_n) * triton.cdiv(k, block_k), experts)
    _kernel[fixed](
        *args, **flags, PREFETCH=prefetch, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
