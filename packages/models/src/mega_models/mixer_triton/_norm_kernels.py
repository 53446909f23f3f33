# mypy: ignore-errors
# (Triton ships no type information; the typed entry point is ``_norm.py``.)
"""Gated RMSNorm per group: rows ``[L, G, W]`` (a row of one group is its ``W`` channels).

``gate = y silu(z)``, ``rstd = (mean(gate^2) + eps)^-1/2``, ``out = gate rstd w``. Backward
from the saved ``rstd`` (gate recomputed): with ``n = gate rstd`` and ``dn = dout w``,
``dgate = rstd (dn - n mean(dn n))``, ``dy = dgate silu(z)``, ``dz = dgate y silu'(z)``,
``dw = sum_rows dout n``, written per program (one row per part of the rows) and summed
afterwards in torch, a fixed order.
"""

import triton
import triton.language as tl

from mega_models.mixer_triton._configs import configs


@triton.jit
def _tile(base, rows, s_l, s_w, offset, cols, ok, ACC: tl.constexpr):
    ptr = base + rows[:, None] * s_l + offset + cols[None, :] * s_w
    return tl.load(ptr, mask=ok, other=0.0).to(ACC)


@triton.autotune(configs=configs("norm_fwd"), key=["W", "G"])
@triton.jit
def norm_fwd(
    y_ptr, z_ptr, w_ptr, eps_ptr, out_ptr, rstd_ptr, L, G, W,
    sy_l, sy_g, sy_w, sz_l, sz_g, sz_w, so_l, so_g, so_w,
    ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Per (group, block of rows): ``out`` and ``rstd`` ``[L, G]``."""
    gi = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_W)
    r_ok = rows < L
    ok = r_ok[:, None] & (cols < W)[None, :]
    y = _tile(y_ptr, rows, sy_l, sy_w, gi * sy_g, cols, ok, ACC)
    z = _tile(z_ptr, rows, sz_l, sz_w, gi * sz_g, cols, ok, ACC)
    gate = y * z * tl.sigmoid(z)
    eps = tl.load(eps_ptr)
    rstd = tl.rsqrt(tl.sum(gate * gate, 1) / W + eps)
    w = tl.load(w_ptr + gi * W + cols, mask=cols < W, other=0.0).to(ACC)
    out = gate * rstd[:, None] * w[None, :]
    ptr = out_ptr + rows[:, None] * so_l + gi * so_g + cols[None, :] * so_w
    tl.store(ptr, out.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(rstd_ptr + rows * G + gi, rstd, mask=r_ok)


@triton.autotune(configs=configs("norm_bwd"), key=["W", "G"])
@triton.jit
def norm_bwd(
    y_ptr, z_ptr, w_ptr, rstd_ptr, do_ptr, dy_ptr, dz_ptr, dw_ptr, L, G, W, PART,
    sy_l, sy_g, sy_w, sz_l, sz_g, sz_w, sd_l, sd_g, sd_w,
    ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Per (group, part of the rows): ``dy`` and ``dz`` (laid out like ``dout``) over the
    part's rows, and its sum for ``dw`` at row ``part`` of ``dw_ptr`` ``[parts, G * W]``."""
    gi = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_W)
    c_ok = cols < W
    w = tl.load(w_ptr + gi * W + cols, mask=c_ok, other=0.0).to(ACC)
    dw = tl.zeros((BLOCK_W,), dtype=ACC)
    start = part * PART
    end = tl.minimum(start + PART, L)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        r_ok = rows < end
        ok = r_ok[:, None] & c_ok[None, :]
        y = _tile(y_ptr, rows, sy_l, sy_w, gi * sy_g, cols, ok, ACC)
        z = _tile(z_ptr, rows, sz_l, sz_w, gi * sz_g, cols, ok, ACC)
        dout = _tile(do_ptr, rows, sd_l, sd_w, gi * sd_g, cols, ok, ACC)
        rstd = tl.load(rstd_ptr + rows * G + gi, mask=r_ok, other=0.0)
        sig = tl.sigmoid(z)
        silu = z * sig
        n = y * silu * rstd[:, None]
        dn = dout * w[None, :]
        dw += tl.sum(dout * n, 0)
        dgate = rstd[:, None] * (dn - n * (tl.sum(dn * n, 1) / W)[:, None])
        dy = dgate * silu
        dz = dgate * y * sig * (1.0 + z * (1.0 - sig))
        offsets = rows[:, None] * sd_l + gi * sd_g + cols[None, :] * sd_w
        tl.store(dy_ptr + offsets, dy.to(dy_ptr.dtype.element_ty), mask=ok)
        tl.store(dz_ptr + offsets, dz.to(dz_ptr.dtype.element_ty), mask=ok)
    tl.store(dw_ptr + part * G * W + gi * W + cols, dw, mask=c_ok)
