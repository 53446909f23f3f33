# mypy: ignore-errors
# (Triton ships no type information; the typed entry point is ``_function.py``.)
"""Forward kernels of the chunked SSD scan.

Notation (one batch row ``b``, one head ``h`` of group ``g``, one chunk ``c`` of ``Q`` steps):
``a_t = dt_t A_h``; ``s_t`` the running sum of ``a`` inside the chunk (inclusive);
``T_c = s_{Q-1}`` the whole chunk's log-decay. Then

* chunk state  ``S_c = sum_t exp(T_c - s_t) dt_t x_t B_t^T``           ``[p, n]``
* entering     ``H_0 = 0``, ``H_{c+1} = exp(T_c) H_c + S_c``
* output       ``y_i = exp(s_i) H_c C_i + sum_{j<=i} exp(s_i - s_j) (C_i . B_j) dt_j x_j + D x_i``

The scores ``C_i . B_j`` belong to the group, not the head: ``chunk_scores_fwd`` computes them
once per (chunk, group, batch), in ``ACC``, for the scan and the backward to read.

Positions past the sequence end (the last chunk's tail) read as zero input with zero ``dt``,
so they neither decay nor feed anything. Accumulation is in ``ACC`` (fp32, or fp64 for fp64
inputs); matmul operands are in the inputs' dtype.
"""

import triton
import triton.language as tl

from mega_models.ssd_triton._configs import configs
from mega_models.ssd_triton._tiles import causal_decay, load_scores, load_tile, store_tile


@triton.autotune(configs=configs("state"), key=["Q", "P", "N"])
@triton.jit
def chunk_state_fwd(
    x_ptr, dt_ptr, A_ptr, B_ptr, states_ptr, cum_ptr,
    L, H, R, Q, P, N, n_chunks,
    sx_l, sx_b, sx_h, sx_p,
    sdt_l, sdt_b, sdt_h,
    sB_l, sB_b, sB_g, sB_n,
    ACC: tl.constexpr, PREC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Per (head, chunk, batch): the running log-decay ``s`` (stored) and ``S_c`` (stored)."""
    hh = tl.program_id(0)  # the heads of a group side by side: they read the same B, C
    c = tl.program_id(1)
    bb = tl.program_id(2).to(tl.int64)
    g = hh // R
    a_h = tl.load(A_ptr + hh).to(ACC)
    rt = tl.arange(0, BLOCK_T)
    rp = tl.arange(0, BLOCK_P)
    rn = tl.arange(0, BLOCK_N)
    dt_base = dt_ptr + bb * sdt_b + hh * sdt_h
    # the whole chunk's log-decay first: each step's weight is exp(T - s_t)
    total = tl.zeros((BLOCK_T,), dtype=ACC)
    for k in range(0, Q, BLOCK_T):
        lt = k + rt
        t = c * Q + lt
        dt = tl.load(dt_base + t * sdt_l, mask=(lt < Q) & (t < L), other=0.0).to(ACC)
        total += dt * a_h
    chunk_total = tl.sum(total, 0)
    x_base = x_ptr + bb * sx_b + hh * sx_h
    B_base = B_ptr + bb * sB_b + g * sB_g
    cum_base = cum_ptr + (bb * H + hh) * n_chunks * Q + c * Q
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=ACC)
    offset = chunk_total * 0.0  # the running sum before this block
    for k in range(0, Q, BLOCK_T):
        lt = k + rt
        t = c * Q + lt
        valid = (lt < Q) & (t < L)
        dt = tl.load(dt_base + t * sdt_l, mask=valid, other=0.0).to(ACC)
        s = tl.cumsum(dt * a_h, 0) + offset
        offset += tl.sum(dt * a_h, 0)
        tl.store(cum_base + lt, s, mask=lt < Q)
        x = load_tile(x_base, t, sx_l, valid, rp, sx_p, P)
        Bt = load_tile(B_base, t, sB_l, valid, rn, sB_n, N)
        w = tl.exp(chunk_total - s) * dt  # [T]
        xw = (x.to(ACC) * w[:, None]).to(Bt.dtype)
        acc = tl.dot(tl.trans(xw), Bt, acc, out_dtype=ACC, input_precision=PREC)  # [P, T] @ [T, N]
    out = states_ptr + ((bb * n_chunks + c) * H + hh) * P * N
    store_tile(out, rp, N, rp < P, rn, 1, N, acc)


@triton.autotune(configs=configs("scores"), key=["Q", "N"])
@triton.jit
def chunk_scores_fwd(
    B_ptr, C_ptr, scores_ptr,
    L, G, Q, N, n_chunks,
    sB_l, sB_b, sB_g, sB_n,
    sC_l, sC_b, sC_g, sC_n,
    ACC: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Per (block of steps i, group, chunk * batch): ``C_i . B_j`` for the blocks of steps
    ``j`` that reach ``j <= i``, to ``scores[b, c, g, i, j]`` ``[Q, Q]`` (zero past the
    sequence end)."""
    c = tl.program_id(2) % n_chunks
    bb = (tl.program_id(2) // n_chunks).to(tl.int64)
    g = tl.program_id(1)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    li = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ti = c * Q + li
    vi = (li < Q) & (ti < L)
    Ci = load_tile(C_ptr + bb * sC_b + g * sC_g, ti, sC_l, vi, rn, sC_n, N)
    B_base = B_ptr + bb * sB_b + g * sB_g
    out = scores_ptr + ((bb * n_chunks + c) * G + g) * Q * Q
    end = tl.minimum((tl.program_id(0) + 1) * BLOCK_M, Q)
    for k in range(0, end, BLOCK_K):
        lj = k + rk
        tj = c * Q + lj
        Bj = load_tile(B_base, tj, sB_l, (lj < Q) & (tj < L), rn, sB_n, N)
        scores = tl.dot(Ci, tl.trans(Bj), out_dtype=ACC, input_precision=PREC)  # [M, K]
        store_tile(out, li, Q, li < Q, lj, 1, Q, scores)


@triton.jit
def state_pass_fwd(
    states_ptr, cum_ptr, final_ptr, H, Q, PN, n_chunks,
    ACC: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Per (batch * head, slice of p*n): chunk states -> entering states, in place; the final
    state to ``final``."""
    bh = tl.program_id(0).to(tl.int64)
    bb = bh // H
    hh = bh % H
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < PN
    state = tl.zeros((BLOCK,), dtype=ACC)
    for c in range(0, n_chunks):
        ptr = states_ptr + ((bb * n_chunks + c) * H + hh) * PN + offs
        own = tl.load(ptr, mask=m, other=0.0)
        tl.store(ptr, state, mask=m)
        decay = tl.exp(tl.load(cum_ptr + bh * n_chunks * Q + c * Q + Q - 1))
        state = decay * state + own
    tl.store(final_ptr + bh * PN + offs, state, mask=m)


@triton.autotune(configs=configs("scan"), key=["Q", "P", "N"])
@triton.jit
def chunk_scan_fwd(
    x_ptr, dt_ptr, C_ptr, scores_ptr, D_ptr, y_ptr, states_ptr, cum_ptr,
    L, H, R, Q, P, N, n_chunks,
    sx_l, sx_b, sx_h, sx_p,
    sdt_l, sdt_b, sdt_h,
    sC_l, sC_b, sC_g, sC_n,
    sy_l, sy_b, sy_h, sy_p,
    HAS_D: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Per (block of output steps, head, chunk * batch), the blocks of one chunk and the heads
    of one group next to each other (they read the same scores and C): ``y``."""
    c = tl.program_id(2) % n_chunks
    bb = (tl.program_id(2) // n_chunks).to(tl.int64)
    hh = tl.program_id(1)
    g = hh // R
    rp = tl.arange(0, BLOCK_P)
    rn = tl.arange(0, BLOCK_N)
    li = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ti = c * Q + li
    vi = (li < Q) & (ti < L)
    cum_base = cum_ptr + (bb * H + hh) * n_chunks * Q + c * Q
    s_i = tl.load(cum_base + li, mask=li < Q, other=0.0)
    C_base = C_ptr + bb * sC_b + g * sC_g
    Ci = load_tile(C_base, ti, sC_l, vi, rn, sC_n, N)
    # the entering state's part: exp(s_i) C_i H_c^T
    st = states_ptr + ((bb * n_chunks + c) * H + hh) * P * N
    Hc = load_tile(st, rn, 1, rn < N, rp, N, P)  # [N, P]
    acc = (
        tl.dot(Ci, Hc.to(Ci.dtype), out_dtype=ACC, input_precision=PREC) * tl.exp(s_i)[:, None]
    )  # [M, P]
    x_base = x_ptr + bb * sx_b + hh * sx_h
    dt_base = dt_ptr + bb * sdt_b + hh * sdt_h
    scores_base = scores_ptr + ((bb * n_chunks + c) * (H // R) + g) * Q * Q
    rk = tl.arange(0, BLOCK_K)
    end = tl.minimum((tl.program_id(0) + 1) * BLOCK_M, Q)
    for k in range(0, end, BLOCK_K):
        lj = k + rk
        tj = c * Q + lj
        vj = (lj < Q) & (tj < L)
        s_j = tl.load(cum_base + lj, mask=lj < Q, other=0.0)
        dt_j = tl.load(dt_base + tj * sdt_l, mask=vj, other=0.0).to(ACC)
        scores = load_scores(scores_base, li, lj, Q, True)  # [M, K]
        decay = causal_decay(s_i, li, s_j, lj, True)
        xj = load_tile(x_base, tj, sx_l, vj, rp, sx_p, P)
        w = (scores * decay * dt_j[None, :]).to(xj.dtype)
        acc = tl.dot(w, xj, acc, out_dtype=ACC, input_precision=PREC)
    if HAS_D:
        xi = load_tile(x_base, ti, sx_l, vi, rp, sx_p, P)
        acc += tl.load(D_ptr + hh).to(ACC) * xi.to(ACC)
    y_base = y_ptr + bb * sy_b + hh * sy_h
    store_tile(y_base, ti, sy_l, vi, rp, sy_p, P, acc)
