# mypy: ignore-errors
# (Triton ships no type information; the typed entry point is ``_function.py``.)
"""Backward kernels of the chunked SSD scan (notation of ``_fwd.py``; ``dy`` the output
gradient, ``dH_c`` the gradient of the state entering chunk ``c`` in total).

* ``dstate_bwd``    what chunk ``c``'s outputs send to its entering state:
                     ``sum_i exp(s_i) dy_i C_i^T``
* ``state_pass_bwd`` back through ``H_{c+1} = exp(T_c) H_c + S_c``: ``dS_c = dH_{c+1}``,
                     and ``<H_{c+1}, dH_{c+1}>``, the gradient of the chunk's end log-decay
                     ``T_c`` (through both the carried state and the chunk state's weights)
* ``dc_bwd``        ``dC`` per group, and per head ``dy_i . (y_i - D x_i)``, the gradient of
                     ``s_i`` as the later end of every decay it closes
* ``dx_bwd``        ``dx``, ``ddt``, and per chunk the partial sums of ``dA`` and ``dD``
* ``db_bwd``        ``dB`` per group

The group's scores ``C_i . B_j`` come from the forward (``chunk_scores_fwd``), not redone per
head; ``dc_bwd`` and ``db_bwd`` sum the heads' ``[i, j]`` weights (in ``ACC``) before their one
product with the group's ``B_j`` or ``C_i`` per block of steps.

The gradient of ``s_k`` is ``dy_k . (y_k - D x_k) - dt_k x_k . u_k`` (plus ``<H_{c+1},
dH_{c+1}>`` at the chunk's last step), with ``u_k`` what ``dx_k / dt_k`` collects; ``a``'s is
its reverse running sum over the chunk, which gives ``ddt += A da`` and ``dA = sum dt da``.
"""

import triton
import triton.language as tl

from mega_models.ssd_triton._configs import configs
from mega_models.ssd_triton._tiles import causal_decay, load_scores, load_tile, store_tile


@triton.autotune(configs=configs("state"), key=["Q", "P", "N"])
@triton.jit
def dstate_bwd(
    dy_ptr, C_ptr, cum_ptr, dstates_ptr,
    L, H, R, Q, P, N, n_chunks,
    sy_l, sy_b, sy_h, sy_p,
    sC_l, sC_b, sC_g, sC_n,
    ACC: tl.constexpr, PREC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Per (head, chunk, batch): ``sum_i exp(s_i) dy_i C_i^T`` ``[p, n]``."""
    hh = tl.program_id(0)  # the heads of a group side by side: they read the same B, C
    c = tl.program_id(1)
    bb = tl.program_id(2).to(tl.int64)
    g = hh // R
    rt = tl.arange(0, BLOCK_T)
    rp = tl.arange(0, BLOCK_P)
    rn = tl.arange(0, BLOCK_N)
    dy_base = dy_ptr + bb * sy_b + hh * sy_h
    C_base = C_ptr + bb * sC_b + g * sC_g
    cum_base = cum_ptr + (bb * H + hh) * n_chunks * Q + c * Q
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=ACC)
    for k in range(0, Q, BLOCK_T):
        lt = k + rt
        t = c * Q + lt
        valid = (lt < Q) & (t < L)
        s = tl.load(cum_base + lt, mask=lt < Q, other=0.0)
        dy = load_tile(dy_base, t, sy_l, valid, rp, sy_p, P)
        Ct = load_tile(C_base, t, sC_l, valid, rn, sC_n, N)
        dyw = (dy.to(ACC) * tl.exp(s)[:, None]).to(Ct.dtype)
        acc = tl.dot(tl.trans(dyw), Ct, acc, out_dtype=ACC, input_precision=PREC)
    out = dstates_ptr + ((bb * n_chunks + c) * H + hh) * P * N
    store_tile(out, rp, N, rp < P, rn, 1, N, acc)


@triton.jit
def state_pass_bwd(
    states_ptr, final_ptr, dstates_ptr, cum_ptr, ends_ptr, H, Q, PN, n_chunks, n_blocks,
    ACC: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Per (batch * head, slice of p*n), last chunk first: ``dstates`` (each chunk's own
    ``dy`` term) becomes ``dS_c``, in place; ``ends[bh, slice, c]`` the slice's part of
    ``<H_{c+1}, dH_{c+1}>``."""
    bh = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    bb = bh // H
    hh = bh % H
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < PN
    grad = tl.zeros((BLOCK,), dtype=ACC)  # the final state has no gradient
    later = tl.load(final_ptr + bh * PN + offs, mask=m, other=0.0)  # H_{c+1}
    for i in range(0, n_chunks):
        c = n_chunks - 1 - i
        row = ((bb * n_chunks + c) * H + hh) * PN + offs
        own = tl.load(dstates_ptr + row, mask=m, other=0.0)
        tl.store(ends_ptr + (bh * n_blocks + blk) * n_chunks + c, tl.sum(later * grad, 0))
        tl.store(dstates_ptr + row, grad, mask=m)
        decay = tl.exp(tl.load(cum_ptr + bh * n_chunks * Q + c * Q + Q - 1))
        grad = own + decay * grad
        later = tl.load(states_ptr + row, mask=m, other=0.0)


@triton.autotune(configs=configs("dbc"), key=["Q", "P", "N", "R"])
@triton.jit
def dc_bwd(
    x_ptr, dt_ptr, B_ptr, C_ptr, dy_ptr, states_ptr, cum_ptr, scores_ptr, dC_ptr, rows_ptr,
    L, H, R, Q, P, N, n_chunks,
    sx_l, sx_b, sx_h, sx_p,
    sdt_l, sdt_b, sdt_h,
    sB_l, sB_b, sB_g, sB_n,
    sC_l, sC_b, sC_g, sC_n,
    sy_l, sy_b, sy_h, sy_p,
    sdC_l, sdC_b, sdC_g, sdC_n,
    ACC: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Per (block of steps i, group, chunk * batch):
    ``dC_i = sum_h exp(s_i) dy_i H_c + sum_{j<=i} [sum_h exp(s_i - s_j) dt_j (dy_i . x_j)] B_j``
    (the heads' weights summed before the one product with ``B_j``, per block of steps j);
    per head ``rows[b, h, i] = dy_i . (y_i - D x_i)``."""
    c = tl.program_id(2) % n_chunks
    bb = (tl.program_id(2) // n_chunks).to(tl.int64)
    g = tl.program_id(1)
    rp = tl.arange(0, BLOCK_P)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)
    li = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ti = c * Q + li
    vi = (li < Q) & (ti < L)
    C_base = C_ptr + bb * sC_b + g * sC_g
    B_base = B_ptr + bb * sB_b + g * sB_g
    scores_base = scores_ptr + ((bb * n_chunks + c) * (H // R) + g) * Q * Q
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    rows = tl.zeros((BLOCK_M, BLOCK_R), dtype=ACC)  # a column per head of the group
    # the entering states' part, head by head
    Ci = load_tile(C_base, ti, sC_l, vi, rn, sC_n, N)
    for r in range(0, R):
        hh = g * R + r
        cum_base = cum_ptr + (bb * H + hh) * n_chunks * Q + c * Q
        s_i = tl.load(cum_base + li, mask=li < Q, other=0.0)
        dyi = load_tile(dy_ptr + bb * sy_b + hh * sy_h, ti, sy_l, vi, rp, sy_p, P)
        st = states_ptr + ((bb * n_chunks + c) * H + hh) * P * N
        Hc = load_tile(st, rp, N, rp < P, rn, 1, N)  # [P, N]
        entering = (
            tl.dot(dyi, Hc.to(dyi.dtype), out_dtype=ACC, input_precision=PREC)
            * tl.exp(s_i)[:, None]
        )  # [M, N]
        acc += entering
        row = tl.sum(entering * Ci.to(ACC), 1)  # dy_i . (exp(s_i) H_c C_i)
        rows += tl.where(rr[None, :] == r, row[:, None], 0.0)
    # the intra-chunk part: blocks of steps j outside, the group's heads inside
    end = tl.minimum((tl.program_id(0) + 1) * BLOCK_M, Q)
    for k in range(0, end, BLOCK_K):
        lj = k + rk
        tj = c * Q + lj
        vj = (lj < Q) & (tj < L)
        scores = load_scores(scores_base, li, lj, Q, True)  # [M, K]: C_i . B_j
        weights = tl.zeros((BLOCK_M, BLOCK_K), dtype=ACC)
        for r in range(0, R):
            hh = g * R + r
            cum_base = cum_ptr + (bb * H + hh) * n_chunks * Q + c * Q
            s_i = tl.load(cum_base + li, mask=li < Q, other=0.0)
            s_j = tl.load(cum_base + lj, mask=lj < Q, other=0.0)
            dt_j = tl.load(dt_ptr + bb * sdt_b + hh * sdt_h + tj * sdt_l, mask=vj,
                           other=0.0).to(ACC)  # fmt: skip
            dyi = load_tile(dy_ptr + bb * sy_b + hh * sy_h, ti, sy_l, vi, rp, sy_p, P)
            xj = load_tile(x_ptr + bb * sx_b + hh * sx_h, tj, sx_l, vj, rp, sx_p, P)
            decay = causal_decay(s_i, li, s_j, lj, True)
            w = (
                tl.dot(dyi, tl.trans(xj), out_dtype=ACC, input_precision=PREC)
                * decay
                * dt_j[None, :]
            )  # [M, K]
            weights += w
            row = tl.sum(w * scores, 1)  # dy_i . (this block's part of y_i)
            rows += tl.where(rr[None, :] == r, row[:, None], 0.0)
        Bj = load_tile(B_base, tj, sB_l, vj, rn, sB_n, N)
        acc = tl.dot(weights.to(Bj.dtype), Bj, acc, out_dtype=ACC, input_precision=PREC)
    heads = (bb * H + g * R + rr[None, :]) * n_chunks * Q
    tl.store(rows_ptr + heads + c * Q + li[:, None], rows,
             mask=(li[:, None] < Q) & (rr[None, :] < R))  # fmt: skip
    store_tile(dC_ptr + bb * sdC_b + g * sdC_g, ti, sdC_l, vi, rn, sdC_n, N, acc)


@triton.autotune(configs=configs("dx"), key=["Q", "P", "N"])
@triton.jit
def dx_bwd(
    x_ptr, dt_ptr, A_ptr, B_ptr, scores_ptr, D_ptr, dy_ptr, dstates_ptr, cum_ptr, ends_ptr,
    rows_ptr, dx_ptr, ddt_ptr, dA_ptr, dD_ptr,
    L, H, R, Q, P, N, n_chunks,
    sx_l, sx_b, sx_h, sx_p,
    sdt_l, sdt_b, sdt_h,
    sB_l, sB_b, sB_g, sB_n,
    sy_l, sy_b, sy_h, sy_p,
    sdx_l, sdx_b, sdx_h, sdx_p,
    sddt_l, sddt_b, sddt_h,
    HAS_D: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Per (head, chunk, batch), the whole chunk's steps j at once:
    ``u_j = exp(T - s_j) dS_c B_j + sum_{i>=j} exp(s_i - s_j) (B_j . C_i) dy_i``,
    ``dx_j = dt_j u_j + D dy_j``, ``ddt_j = x_j . u_j + A da_j``; ``dA``, ``dD`` partials."""
    hh = tl.program_id(0)  # the heads of a group side by side: they read the same B, scores
    c = tl.program_id(1)
    bb = tl.program_id(2).to(tl.int64)
    g = hh // R
    rp = tl.arange(0, BLOCK_P)
    rn = tl.arange(0, BLOCK_N)
    lj = tl.arange(0, BLOCK_Q)
    tj = c * Q + lj
    vj = (lj < Q) & (tj < L)
    cum_base = cum_ptr + (bb * H + hh) * n_chunks * Q + c * Q
    s_j = tl.load(cum_base + lj, mask=lj < Q, other=0.0)
    total = tl.load(cum_base + Q - 1)
    B_base = B_ptr + bb * sB_b + g * sB_g
    scores_base = scores_ptr + ((bb * n_chunks + c) * (H // R) + g) * Q * Q
    dy_base = dy_ptr + bb * sy_b + hh * sy_h
    Bj = load_tile(B_base, tj, sB_l, vj, rn, sB_n, N)
    st = dstates_ptr + ((bb * n_chunks + c) * H + hh) * P * N
    dS = load_tile(st, rn, 1, rn < N, rp, N, P)  # [N, P]
    u = (
        tl.dot(Bj, dS.to(Bj.dtype), out_dtype=ACC, input_precision=PREC)
        * tl.exp(total - s_j)[:, None]
    )  # [Q, P]
    ri = tl.arange(0, BLOCK_I)
    for k in range(0, Q, BLOCK_I):
        li = k + ri
        ti = c * Q + li
        vi = (li < Q) & (ti < L)
        dyi = load_tile(dy_base, ti, sy_l, vi, rp, sy_p, P)
        s_i = tl.load(cum_base + li, mask=li < Q, other=0.0)
        decay = causal_decay(s_j, lj, s_i, li, False)
        w = load_scores(scores_base, li, lj, Q, False) * decay  # [Q, I]: (B_j . C_i)
        u = tl.dot(w.to(dyi.dtype), dyi, u, out_dtype=ACC, input_precision=PREC)
    x = load_tile(x_ptr + bb * sx_b + hh * sx_h, tj, sx_l, vj, rp, sx_p, P).to(ACC)
    dt = tl.load(dt_ptr + bb * sdt_b + hh * sdt_h + tj * sdt_l, mask=vj, other=0.0).to(ACC)
    dy = load_tile(dy_base, tj, sy_l, vj, rp, sy_p, P).to(ACC)
    dx = u * dt[:, None]
    if HAS_D:
        dx += tl.load(D_ptr + hh).to(ACC) * dy
        tl.store(dD_ptr + (bb * n_chunks + c) * H + hh, tl.sum(tl.sum(dy * x, 1), 0))
    store_tile(dx_ptr + bb * sdx_b + hh * sdx_h, tj, sdx_l, vj, rp, sdx_p, P, dx)
    direct = tl.sum(u * x, 1)  # [Q]
    rows = tl.load(rows_ptr + (bb * H + hh) * n_chunks * Q + c * Q + lj, mask=lj < Q, other=0.0)
    end_grad = tl.load(ends_ptr + (bb * H + hh) * n_chunks + c)
    dcum = rows - dt * direct + tl.where(lj == Q - 1, end_grad, 0.0)
    da = tl.cumsum(dcum, 0, reverse=True)
    a_h = tl.load(A_ptr + hh).to(ACC)
    tl.store(ddt_ptr + bb * sddt_b + hh * sddt_h + tj * sddt_l,
             (direct + a_h * da).to(ddt_ptr.dtype.element_ty), mask=vj)  # fmt: skip
    tl.store(dA_ptr + (bb * n_chunks + c) * H + hh, tl.sum(da * dt, 0))


@triton.autotune(configs=configs("dbc"), key=["Q", "P", "N", "R"])
@triton.jit
def db_bwd(
    x_ptr, dt_ptr, C_ptr, dy_ptr, dstates_ptr, cum_ptr, dB_ptr,
    L, H, R, Q, P, N, n_chunks,
    sx_l, sx_b, sx_h, sx_p,
    sdt_l, sdt_b, sdt_h,
    sC_l, sC_b, sC_g, sC_n,
    sy_l, sy_b, sy_h, sy_p,
    sdB_l, sdB_b, sdB_g, sdB_n,
    ACC: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Per (block of steps j, group, chunk * batch):
    ``dB_j = sum_h dt_j exp(T - s_j) x_j dS_c
    + sum_{i>=j} [sum_h dt_j exp(s_i - s_j) (dy_i . x_j)] C_i``
    (the heads' weights summed before the one product with ``C_i``, per block of steps i)."""
    c = tl.program_id(2) % n_chunks
    bb = (tl.program_id(2) // n_chunks).to(tl.int64)
    g = tl.program_id(1)
    rp = tl.arange(0, BLOCK_P)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    start = tl.program_id(0) * BLOCK_M
    lj = start + tl.arange(0, BLOCK_M)
    tj = c * Q + lj
    vj = (lj < Q) & (tj < L)
    C_base = C_ptr + bb * sC_b + g * sC_g
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    # the chunk states' part, head by head
    for r in range(0, R):
        hh = g * R + r
        cum_base = cum_ptr + (bb * H + hh) * n_chunks * Q + c * Q
        s_j = tl.load(cum_base + lj, mask=lj < Q, other=0.0)
        total = tl.load(cum_base + Q - 1)
        dt_j = tl.load(dt_ptr + bb * sdt_b + hh * sdt_h + tj * sdt_l, mask=vj, other=0.0).to(ACC)
        xj = load_tile(x_ptr + bb * sx_b + hh * sx_h, tj, sx_l, vj, rp, sx_p, P)
        st = dstates_ptr + ((bb * n_chunks + c) * H + hh) * P * N
        dS = load_tile(st, rp, N, rp < P, rn, 1, N)  # [P, N]
        acc += (
            tl.dot(xj, dS.to(xj.dtype), out_dtype=ACC, input_precision=PREC)
            * (tl.exp(total - s_j) * dt_j)[:, None]
        )
    # the intra-chunk part: blocks of steps i outside, the group's heads inside
    for k in range(start, Q, BLOCK_K):
        li = k + rk
        ti = c * Q + li
        vi = (li < Q) & (ti < L)
        weights = tl.zeros((BLOCK_M, BLOCK_K), dtype=ACC)
        for r in range(0, R):
            hh = g * R + r
            cum_base = cum_ptr + (bb * H + hh) * n_chunks * Q + c * Q
            s_j = tl.load(cum_base + lj, mask=lj < Q, other=0.0)
            s_i = tl.load(cum_base + li, mask=li < Q, other=0.0)
            dt_j = tl.load(dt_ptr + bb * sdt_b + hh * sdt_h + tj * sdt_l, mask=vj,
                           other=0.0).to(ACC)  # fmt: skip
            xj = load_tile(x_ptr + bb * sx_b + hh * sx_h, tj, sx_l, vj, rp, sx_p, P)
            dyi = load_tile(dy_ptr + bb * sy_b + hh * sy_h, ti, sy_l, vi, rp, sy_p, P)
            decay = causal_decay(s_j, lj, s_i, li, False)
            weights += (
                tl.dot(xj, tl.trans(dyi), out_dtype=ACC, input_precision=PREC)
                * decay
                * dt_j[:, None]
            )  # [M, K]: dt_j (dy_i . x_j)
        Ci = load_tile(C_base, ti, sC_l, vi, rn, sC_n, N)
        acc = tl.dot(weights.to(Ci.dtype), Ci, acc, out_dtype=ACC, input_precision=PREC)
    store_tile(dB_ptr + bb * sdB_b + g * sdB_g, tj, sdB_l, vj, rn, sdB_n, N, acc)
