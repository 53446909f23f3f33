# mypy: ignore-errors
# (Triton ships no type information; the typed entry point is ``_function.py``.)
"""Tile helpers the SSD kernels share."""

import triton
import triton.language as tl


@triton.jit
def load_tile(base, rows, row_stride, row_ok, cols, col_stride, n_cols):
    """``[len(rows), len(cols)]`` at ``base + rows * row_stride + cols * col_stride``, zero
    where a row is not ``row_ok`` or a column is past ``n_cols``."""
    mask = row_ok[:, None] & (cols[None, :] < n_cols)
    return tl.load(base + rows[:, None] * row_stride + cols[None, :] * col_stride, mask=mask,
                   other=0.0)  # fmt: skip


@triton.jit
def causal_decay(s_rows, l_rows, s_cols, l_cols, ROWS_LATER: tl.constexpr):
    """``exp(s_later - s_earlier)`` between the steps of the rows and of the columns (their
    running log-decays ``s``, their places ``l`` in the chunk), zero where the later one
    (the row's when ``ROWS_LATER``, else the column's) comes before the other."""
    if ROWS_LATER:
        keep = l_rows[:, None] >= l_cols[None, :]
        gap = s_rows[:, None] - s_cols[None, :]
    else:
        keep = l_cols[None, :] >= l_rows[:, None]
        gap = s_cols[None, :] - s_rows[:, None]
    return tl.exp(tl.where(keep, gap, float("-inf")))


@triton.jit
def store_tile(base, rows, row_stride, row_ok, cols, col_stride, n_cols, value):
    """``value`` to the tile :func:`load_tile` reads, cast to the pointer's dtype."""
    mask = row_ok[:, None] & (cols[None, :] < n_cols)
    tl.store(base + rows[:, None] * row_stride + cols[None, :] * col_stride,
             value.to(base.dtype.element_ty), mask=mask)  # fmt: skip


@triton.jit
def load_scores(base, li, lj, Q, I_ROWS: tl.constexpr):
    """A tile of one chunk's ``C_i . B_j`` (``[Q, Q]``, row-major at ``base``, as
    ``chunk_scores_fwd`` stores it) at steps ``li`` and ``lj``: ``[len(li), len(lj)]`` when
    ``I_ROWS``, else ``[len(lj), len(li)]``; zero where ``j > i`` (not all stored) or past
    the chunk."""
    if I_ROWS:
        keep = (lj[None, :] <= li[:, None]) & (li[:, None] < Q)
        return tl.load(base + li[:, None] * Q + lj[None, :], mask=keep, other=0.0)
    else:
        keep = (lj[:, None] <= li[None, :]) & (li[None, :] < Q)
        return tl.load(base + li[None, :] * Q + lj[:, None], mask=keep, other=0.0)
