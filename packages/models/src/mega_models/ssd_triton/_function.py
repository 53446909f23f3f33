"""The chunked SSD scan as one autograd function over the Triton kernels of ``_fwd.py`` and
``_bwd.py``: buffers, launch grids, and the few sums across chunks done in torch."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mega_models.ssd import _check
from mega_models.ssd_triton import _bwd, _fwd


def _pow2(n: int) -> int:
    """The block covering ``n`` (a power of two, at least ``tl.dot``'s 16)."""
    return max(16, 1 << (n - 1).bit_length())


def _acc(dtype: torch.dtype) -> tuple[torch.dtype, Any, str]:
    """Accumulation dtype (torch, triton) for inputs of ``dtype`` (fp64 for fp64, else fp32)
    and the matmuls' input precision: full for fp32 and fp64 inputs, never TF32."""
    import triton.language as tl  # type: ignore[import-untyped]

    if dtype == torch.float64:
        return torch.float64, tl.float64, "ieee"
    return torch.float32, tl.float32, "ieee" if dtype == torch.float32 else "tf32"


def _pass_block(pn: int) -> int:
    return min(1024, _pow2(pn))


def _chunk_scores(B: Tensor, C: Tensor, q: int) -> Tensor:
    """``C_i . B_j`` per (batch, chunk, group), once for the group's heads: ``[b, c, g, q, q]``
    in the accumulation dtype (only ``j <= i`` is written and read)."""
    length, b, g, n = B.shape
    c = -(-length // q)
    acc_t, acc, prec = _acc(B.dtype)
    scores = torch.empty(b, c, g, q, q, device=B.device, dtype=acc_t)

    def grid(meta: dict[str, int]) -> tuple[int, int, int]:
        return (-(-q // meta["BLOCK_M"]), g, c * b)

    _fwd.chunk_scores_fwd[grid](
        B, C, scores, length, g, q, n, c, *B.stride(), *C.stride(),
        ACC=acc, PREC=prec, BLOCK_N=_pow2(n),
    )  # fmt: skip
    return scores


class _SSDScan(torch.autograd.Function):
    """fwd: chunk states, state passing, chunk scan · bwd: the duals, last chunk first."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, q: int, D: Tensor | None
    ) -> Tensor:
        length, b, h, p = x.shape
        g, n = B.shape[2], B.shape[3]
        r, c = h // g, -(-length // q)
        acc_t, acc, prec = _acc(x.dtype)
        cum = torch.empty(b, h, c * q, device=x.device, dtype=acc_t)
        states = torch.empty(b, c, h, p, n, device=x.device, dtype=acc_t)
        final = torch.empty(b, h, p, n, device=x.device, dtype=acc_t)
        blocks = {"ACC": acc, "PREC": prec, "BLOCK_P": _pow2(p), "BLOCK_N": _pow2(n)}
        shape = (length, h, r, q, p, n, c)
        _fwd.chunk_state_fwd[(h, c, b)](
            x, dt, A, B, states, cum, *shape, *x.stride(), *dt.stride(), *B.stride(), **blocks
        )
        pblock = _pass_block(p * n)
        _fwd.state_pass_fwd[(b * h, -(-p * n // pblock))](
            states, cum, final, h, q, p * n, c, ACC=acc, BLOCK=pblock
        )
        y = torch.empty(length, b, h, p, device=x.device, dtype=x.dtype)

        scores = _chunk_scores(B, C, q)  # saved: b * c * g * q * q in ACC, 34 MB at 1B sizes

        def scan_grid(meta: dict[str, int]) -> tuple[int, int, int]:
            return (-(-q // meta["BLOCK_M"]), h, c * b)  # a chunk's blocks side by side

        _fwd.chunk_scan_fwd[scan_grid](
            x, dt, C, scores, x if D is None else D, y, states, cum, *shape,
            *x.stride(), *dt.stride(), *C.stride(), *y.stride(),
            HAS_D=D is not None, **blocks,
        )  # fmt: skip
        ctx.save_for_backward(x, dt, A, B, C, D, states, cum, final, scores)
        ctx.q = q
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, dt, A, B, C, D, states, cum, final, scores = ctx.saved_tensors
        q = ctx.q
        dy = dy.to(x.dtype)
        length, b, h, p = x.shape
        g, n = B.shape[2], B.shape[3]
        r, c = h // g, -(-length // q)
        acc_t, acc, prec = _acc(x.dtype)
        dev = x.device
        blocks = {"ACC": acc, "PREC": prec, "BLOCK_P": _pow2(p), "BLOCK_N": _pow2(n)}
        shape = (length, h, r, q, p, n, c)
        dstates = torch.empty_like(states)
        _bwd.dstate_bwd[(h, c, b)](dy, C, cum, dstates, *shape, *dy.stride(), *C.stride(), **blocks)
        pblock = _pass_block(p * n)
        n_blocks = -(-p * n // pblock)
        ends = torch.empty(b * h, n_blocks, c, device=dev, dtype=acc_t)
        _bwd.state_pass_bwd[(b * h, n_blocks)](
            states, final, dstates, cum, ends, h, q, p * n, c, n_blocks, ACC=acc, BLOCK=pblock
        )
        ends = ends.sum(1)  # [b * h, c]

        def group_grid(meta: dict[str, int]) -> tuple[int, int, int]:
            return (-(-q // meta["BLOCK_M"]), g, c * b)

        rows = torch.empty(b, h, c * q, device=dev, dtype=acc_t)
        dC = torch.empty(C.shape, device=dev, dtype=C.dtype)
        _bwd.dc_bwd[group_grid](
            x, dt, B, C, dy, states, cum, scores, dC, rows, *shape,
            *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *dy.stride(), *dC.stride(),
            BLOCK_R=max(2, 1 << (r - 1).bit_length()), **blocks,
        )  # fmt: skip
        dx = torch.empty(x.shape, device=dev, dtype=x.dtype)
        ddt = torch.empty(dt.shape, device=dev, dtype=dt.dtype)
        dA = torch.empty(b, c, h, device=dev, dtype=acc_t)
        dD = torch.empty(b, c, h, device=dev, dtype=acc_t) if D is not None else None
        _bwd.dx_bwd[(h, c, b)](
            x, dt, A, B, scores, x if D is None else D, dy, dstates, cum, ends, rows,
            dx, ddt, dA, dA if dD is None else dD, *shape,
            *x.stride(), *dt.stride(), *B.stride(), *dy.stride(), *dx.stride(),
            *ddt.stride(), HAS_D=D is not None, BLOCK_Q=_pow2(q), **blocks,
        )  # fmt: skip
        dB = torch.empty(B.shape, device=dev, dtype=B.dtype)
        _bwd.db_bwd[group_grid](
            x, dt, C, dy, dstates, cum, dB, *shape,
            *x.stride(), *dt.stride(), *C.stride(), *dy.stride(), *dB.stride(), **blocks,
        )  # fmt: skip
        dA_sum = dA.sum((0, 1)).to(A.dtype)
        dD_sum = dD.sum((0, 1)).to(D.dtype) if dD is not None else None
        return dx, ddt, dA_sum, dB, dC, None, dD_sum


def ssd_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor | None
) -> Tensor:
    """Checks, then the autograd function (B and C in x's dtype, as its matmuls need)."""
    _check(x, dt, A, B, C)
    if chunk_size < 1:
        raise ValueError(f"chunk_size ({chunk_size}) must be a positive integer")
    if D is not None and D.shape != A.shape:
        raise ValueError(
            f"D {tuple(D.shape)} must have one value per head, like A {tuple(A.shape)}"
        )
    B, C = B.to(x.dtype), C.to(x.dtype)
    y: Tensor = _SSDScan.apply(x, dt, A, B, C, chunk_size, D)
    return y
