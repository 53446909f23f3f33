# mypy: ignore-errors
# (Triton ships no type information; the typed entry point is ``_conv.py``.)
"""Causal depthwise convolution + SiLU over ``[s, b, g, c]`` (channel ``g * c_g + c``), one
batch row per program, a tile of positions x channels, channels the contiguous dim.

``pre[t] = bias + sum_j w[j] x[t - (K-1) + j]`` (zero before position 0), ``out = silu(pre)``.
Backward, with ``dpre[u] = dy[u] silu'(pre[u])`` (pre recomputed, never saved):
``dx[t] = sum_j w[j] dpre[t + (K-1) - j]``, ``dw[j] = sum_{t,b} dpre[t] x[t - (K-1) + j]``,
``dbias = sum_{t,b} dpre[t]``, in two passes: ``conv_bwd_dpre`` writes dpre (fp32) and the
weight and bias sums, ``conv_bwd_dx`` reads dpre at the K shifts. (One pass that recomputed
the K shifted pre-activations per tile, K^2 loads, measured 1.98 ms for the backward at
hybrid-1b's shape on the H200 against 1.53 ms for the two.) The weight and bias sums are
written per program (one row per batch row and part of the sequence) and summed afterwards
in torch: a fixed order, so the gradients are the same bits on every run, which atomics
would not give.
"""

import triton
import triton.language as tl

from mega_models.mixer_triton._configs import configs


@triton.jit
def _shifted(x_base, t, shift, S, sx_s, cols, c_ok, ACC: tl.constexpr):
    """``x[t + shift]`` for the tile's positions ``t``, zero outside ``[0, S)``: ``[T, C]``."""
    src = t + shift
    ok = (src >= 0) & (src < S)
    ptr = x_base + src.to(tl.int64)[:, None] * sx_s + cols[None, :]
    return tl.load(ptr, mask=ok[:, None] & c_ok[None, :], other=0.0).to(ACC)


@triton.jit
def _tap(x_base, w_row, t, shift, S, sx_s, cols, c_ok, w_offset, ACC: tl.constexpr):
    """One weight of each channel times ``x[t + shift]``."""
    w = tl.load(w_row + w_offset, mask=c_ok, other=0.0).to(ACC)
    return w[None, :] * _shifted(x_base, t, shift, S, sx_s, cols, c_ok, ACC)


@triton.jit
def _pre(x_base, w_row, bias, t, shift, S, sx_s, cols, c_ok, sw_k, K: tl.constexpr,
         ACC: tl.constexpr):  # fmt: skip
    """The pre-activation at positions ``t + shift``: ``[T, C]`` (``w_row``: each channel's
    weights)."""
    acc = bias[None, :] + _tap(x_base, w_row, t, shift - (K - 1), S, sx_s, cols, c_ok, 0, ACC)
    for j in tl.static_range(1, K):
        acc += _tap(x_base, w_row, t, shift - (K - 1) + j, S, sx_s, cols, c_ok, j * sw_k, ACC)
    return acc


@triton.jit
def _channels(CG, CH, sx_g, sx_c, b_ptr, HAS_BIAS: tl.constexpr, ACC: tl.constexpr,
              BLOCK_C: tl.constexpr):  # fmt: skip
    """This program's channels, whether each exists, their offsets in ``x`` and their bias."""
    ch = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = ch < CH
    cols = (ch // CG).to(tl.int64) * sx_g + (ch % CG) * sx_c
    bias = tl.zeros((BLOCK_C,), dtype=ACC)
    if HAS_BIAS:
        bias += tl.load(b_ptr + ch, mask=c_ok, other=0.0).to(ACC)
    return ch, c_ok, cols, bias


@triton.autotune(configs=configs("conv_fwd"), key=["CH", "K"])
@triton.jit
def conv_fwd(
    x_ptr, w_ptr, b_ptr, out_ptr, S, CG, CH,
    sx_s, sx_b, sx_g, sx_c, so_s, so_b, so_g, so_c, sw_c, sw_k,
    HAS_BIAS: tl.constexpr, K: tl.constexpr, ACC: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Per (channel block, position block, batch row): ``silu(pre)``."""
    ch, c_ok, cols, bias = _channels(CG, CH, sx_g, sx_c, b_ptr, HAS_BIAS, ACC, BLOCK_C)
    bb = tl.program_id(2).to(tl.int64)
    t = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    w_row = w_ptr + ch * sw_c
    pre = _pre(x_ptr + bb * sx_b, w_row, bias, t, 0, S, sx_s, cols, c_ok, sw_k, K, ACC)
    out = pre * tl.sigmoid(pre)
    out_cols = (ch // CG).to(tl.int64) * so_g + (ch % CG) * so_c
    ptr = out_ptr + bb * so_b + t.to(tl.int64)[:, None] * so_s + out_cols[None, :]
    tl.store(ptr, out.to(out_ptr.dtype.element_ty), mask=(t < S)[:, None] & c_ok[None, :])


@triton.jit
def _taps(base, t, S, s_s, cols, c_ok, rk, first, K: tl.constexpr, ACC: tl.constexpr):
    """``v[t + first + j]`` for the taps ``j < K`` at once, zero outside ``[0, S)``:
    ``[BLOCK_K, T, C]`` (the K overlapping tiles hit the cache after the first)."""
    src = t[None, :, None] + first + rk[:, None, None]
    ok = (src >= 0) & (src < S) & (rk < K)[:, None, None] & c_ok[None, None, :]
    ptr = base + src.to(tl.int64) * s_s + cols[None, None, :]
    return tl.load(ptr, mask=ok, other=0.0).to(ACC)


@triton.autotune(configs=configs("conv_dpre"), key=["CH", "K"])
@triton.jit
def conv_bwd_dpre(
    x_ptr, w_ptr, b_ptr, dy_ptr, dpre_ptr, dw_ptr, db_ptr, S, CG, CH, PART, n_parts,
    sx_s, sx_b, sx_g, sx_c, sd_s, sd_b, sd_g, sd_c, sw_c, sw_k,
    HAS_BIAS: tl.constexpr, K: tl.constexpr, ACC: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Per (channel block, part of the sequence, batch row): ``dpre`` over the part's
    positions into ``dpre_ptr`` (``[s, b, ch]``, contiguous, the accumulation dtype), and the
    part's sums for ``dw`` and ``dbias`` at row ``batch * n_parts + part`` of ``dw_ptr``
    ``[rows, CH, K]`` and ``db_ptr`` ``[rows, CH]``. The sums stay elementwise over the
    part's tiles and are reduced once at its end."""
    ch, c_ok, cols, bias = _channels(CG, CH, sx_g, sx_c, b_ptr, HAS_BIAS, ACC, BLOCK_C)
    d_cols = (ch // CG).to(tl.int64) * sd_g + (ch % CG) * sd_c
    bb = tl.program_id(2).to(tl.int64)
    part = tl.program_id(1)
    rk = tl.arange(0, BLOCK_K)
    w3 = tl.load(w_ptr + ch[None, :] * sw_c + rk[:, None] * sw_k,
                 mask=(rk < K)[:, None] & c_ok[None, :], other=0.0).to(ACC)[:, None, :]  # fmt: skip
    x_base = x_ptr + bb * sx_b
    dw = tl.zeros((BLOCK_K, BLOCK_S, BLOCK_C), dtype=ACC)
    db = tl.zeros((BLOCK_S, BLOCK_C), dtype=ACC)
    start = part * PART
    end = tl.minimum(start + PART, S)
    for t0 in range(start, end, BLOCK_S):
        t = t0 + tl.arange(0, BLOCK_S)
        own = (t < end)[:, None] & c_ok[None, :]
        xs = _taps(x_base, t, S, sx_s, cols, c_ok, rk, 1 - K, K, ACC)  # x[t - (K-1) + j]
        pre = bias[None, :] + tl.sum(w3 * xs, 0)
        dy = tl.load(dy_ptr + bb * sd_b + t.to(tl.int64)[:, None] * sd_s + d_cols[None, :],
                     mask=own, other=0.0).to(ACC)  # fmt: skip
        sig = tl.sigmoid(pre)
        dpre = tl.where(own, dy * sig * (1.0 + pre * (1.0 - sig)), 0.0)
        db += dpre
        dw += dpre[None, :, :] * xs
        ptr = dpre_ptr + (t.to(tl.int64)[:, None] * tl.num_programs(2) + bb) * CH + ch[None, :]
        tl.store(ptr, dpre, mask=own)
    row = bb * n_parts + part
    tl.store(dw_ptr + (row * CH + ch[None, :]) * K + rk[:, None], tl.sum(dw, 1),
             mask=(rk < K)[:, None] & c_ok[None, :])  # fmt: skip
    tl.store(db_ptr + row * CH + ch, tl.sum(db, 0), mask=c_ok)


@triton.autotune(configs=configs("conv_dx"), key=["CH", "K"])
@triton.jit
def conv_bwd_dx(
    dpre_ptr, w_ptr, dx_ptr, S, CG, CH, sd_s, sd_b, sd_g, sd_c, sw_c, sw_k,
    K: tl.constexpr, ACC: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Per (channel block, position block, batch row): ``dx[t] = sum_j w[j] dpre[t + K-1-j]``
    from ``dpre`` (``[s, b, ch]`` contiguous) into ``dx`` (``[s, b, g, c]``, its strides)."""
    ch = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = ch < CH
    bb = tl.program_id(2).to(tl.int64)
    t = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    rk = tl.arange(0, BLOCK_K)
    # tap j meets dpre at t + (K-1) - j: read taps in reverse, rk = K-1-j
    w3 = tl.load(w_ptr + ch[None, :] * sw_c + (K - 1 - rk[:, None]) * sw_k,
                 mask=(rk < K)[:, None] & c_ok[None, :], other=0.0).to(ACC)[:, None, :]  # fmt: skip
    nb = tl.num_programs(2)
    ds = _taps(dpre_ptr + bb * CH, t, S, nb * CH, ch.to(tl.int64), c_ok, rk, 0, K, ACC)
    dx = tl.sum(w3 * ds, 0)
    d_cols = (ch // CG).to(tl.int64) * sd_g + (ch % CG) * sd_c
    ptr = dx_ptr + bb * sd_b + t.to(tl.int64)[:, None] * sd_s + d_cols[None, :]
    tl.store(ptr, dx.to(dx_ptr.dtype.element_ty), mask=(t < S)[:, None] & c_ok[None, :])
