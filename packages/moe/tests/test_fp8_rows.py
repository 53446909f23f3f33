"""Row-wise e4m3 quantisation, the 16-row padded layout and the emulated fp8 grouped GEMM.

Bounds: e4m3 keeps 3 mantissa bits, so a value in its normal range is stored to within half
a unit in the last place, ``2^-4`` of itself; below 2^-6 (subnormals, step 2^-9) to within
``2^-10`` absolutely, in scaled units (``amax / 448`` a unit). The emulated GEMM multiplies
the widened fp8 values in fp32: it is checked against the same products summed in fp64,
to fp32's rounding of a sum of K terms (``K * 2^-24`` of the sum of their magnitudes).
"""

from __future__ import annotations

import os
from itertools import pairwise

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from mega_moe._fp8_grouped import fp8_grouped_mm
from mega_moe.fp8_rows import (
    FP8_ROW_ALIGN,
    Fp8Rows,
    padded_rows,
    quantize_columns_transposed,
    quantize_rows,
)
from mega_parallel_grid.testing import DistPool, run_kernel_child

_FMAX = 448.0


def _bound(t: Tensor) -> Tensor:
    """The largest |dequantised - t| row-wise e4m3 allows for each element of ``t``."""
    unit = t.abs().amax(dim=-1, keepdim=True) / _FMAX
    return t.abs() * 2.0**-4 + unit * 2.0**-10


def test_quantize_rows_is_within_half_an_ulp() -> None:
    gen = torch.Generator().manual_seed(0)
    # rows of very different magnitudes, and values spanning 2^12 inside a row
    t = torch.randn(3, 64, 40, generator=gen) * torch.logspace(-6, 6, 64).view(1, 64, 1)
    t = t * torch.logspace(-2, 1.6, 40).view(1, 1, 40)
    q = quantize_rows(t)
    assert q.data.dtype == torch.float8_e4m3fn and q.inv_scale.shape == (3, 64)
    err = (q.dequantize() - t).abs()
    assert bool((err <= _bound(t)).all()), float((err / _bound(t)).max())
    # the largest magnitude of each row lands on e4m3's largest value
    top = q.data.float().abs().amax(dim=-1)
    torch.testing.assert_close(top, torch.full_like(top, _FMAX), rtol=0, atol=0)


def test_columns_transposed_are_the_transposes_rows_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(3, 40, 24, generator=gen) * torch.logspace(-4, 4, 24)
    for t in (w, w.bfloat16()):
        got, want = quantize_columns_transposed(t), quantize_rows(t.transpose(1, 2))
        assert got.data.is_contiguous() and got.data.shape == (3, 24, 40)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.inv_scale, want.inv_scale)


def test_quantize_rows_of_zeros_stays_finite() -> None:
    q = quantize_rows(torch.zeros(2, 16))
    assert torch.equal(q.dequantize(), torch.zeros(2, 16))
    assert bool(torch.isfinite(q.inv_scale).all())


@pytest.mark.parametrize("counts", [[5, 0, 17, 16], [0, 0, 3], [16, 32], [1]])
@pytest.mark.parametrize("on_device", [False, True])
def test_padded_rows_keep_order_in_aligned_blocks(counts: list[int], on_device: bool) -> None:
    m = sum(counts)
    layout = padded_rows(torch.tensor(counts) if on_device else counts, m, torch.device("cpu"))
    ends = layout.ends.tolist()
    assert layout.ends.dtype == torch.int32 and ends[-1] == layout.capacity
    starts = [0, *ends[:-1]]
    assert all(s % FP8_ROW_ALIGN == 0 for s in (*starts, layout.capacity))
    dest, row = layout.dest.tolist(), 0
    for c, s, e in zip(counts, starts, ends, strict=True):
        assert dest[row : row + c] == list(range(s, s + c))  # in order, from the block start
        assert e - s >= c
        row += c
    if on_device:  # a bound that depends on m and the experts only: nothing read on the host
        assert layout.capacity == -(-(m + len(counts) * 15) // 16) * 16
    else:
        assert layout.capacity == sum(-(-c // 16) * 16 for c in counts)


def test_padded_scatter_and_gather_round_trip() -> None:
    counts = [3, 0, 20]
    x = torch.randn(23, 32)
    layout = padded_rows(counts, 23, torch.device("cpu"))
    q = quantize_rows(x)
    padded = layout.scatter(q)
    assert padded.data.shape == (layout.capacity, 32)
    back = Fp8Rows(layout.gather(padded.data), layout.gather(padded.inv_scale))
    assert torch.equal(back.dequantize(), q.dequantize())
    pad = torch.ones(layout.capacity, dtype=torch.bool)
    pad[layout.dest] = False
    assert torch.equal(padded.data[pad].float(), torch.zeros(int(pad.sum()), 32))


def test_emulated_grouped_gemm_is_each_group_times_its_weight() -> None:
    gen = torch.Generator().manual_seed(1)
    counts, k, n = [16, 0, 32, 16], 48, 24
    a = quantize_rows(torch.randn(64, k, generator=gen))
    b = quantize_rows(torch.randn(4, n, k, generator=gen))
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = fp8_grouped_mm(a, b, ends, torch.float32)
    xa, wb = a.dequantize().double(), b.dequantize().double()
    bounds = [0, *ends.tolist()]
    for g, (s, e) in enumerate(pairwise(bounds)):
        exact = xa[s:e] @ wb[g].t()
        slack = k * 2.0**-24 * (xa[s:e].abs() @ wb[g].abs().t())
        assert bool(((out[s:e].double() - exact).abs() <= slack).all()), g


def _columns_sharded() -> None:
    """The transposed copy of a weight whose rows are split over the group (etp cuts fc1's
    intermediate rows): each rank's columns scale as one process's whole columns."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(3))
    mine = full.chunk(world, dim=1)[rank]
    q, whole = (
        quantize_columns_transposed(mine, dist.group.WORLD),
        quantize_columns_transposed(full),
    )
    assert torch.equal(q.inv_scale, whole.inv_scale)
    assert torch.equal(
        q.data.view(torch.uint8), whole.data.chunk(world, dim=2)[rank].view(torch.uint8)
    )


def test_sharded_columns_quantise_as_one_process(dist_pool: DistPool) -> None:
    dist_pool.run(_columns_sharded, 2)


def _quantize_sharded(dim: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(6, 40, generator=gen) * torch.logspace(-3, 3, 40)
    full = full if dim == 1 else full.t().contiguous()
    mine = full.chunk(world, dim=-1)[rank]
    q, whole = quantize_rows(mine, dist.group.WORLD), quantize_rows(full)
    assert torch.equal(q.inv_scale, whole.inv_scale)  # the row's amax over every shard
    assert torch.equal(
        q.data.view(torch.uint8), whole.data.chunk(world, dim=-1)[rank].view(torch.uint8)
    )


@pytest.mark.parametrize("dim", [1, 0])
def test_sharded_rows_quantise_as_one_process(dist_pool: DistPool, dim: int) -> None:
    dist_pool.run(_quantize_sharded, 2, args=(dim,))


# the one-pass kernel (quantize_rows_2d) ------------------------------------------------

#: (rows, columns, dtype): one program's row narrower and wider than a warp's, the expert
#: shapes' widths, a single row
KERNEL_CASES = [(5, 40, "float32"), (33, 704, "bfloat16"), (9, 2048, "bfloat16"),
                (1, 1408, "float16")]  # fmt: skip


def check_kernel(rows: int, cols: int, dtype: str, device: str, exact: bool) -> None:
    """The kernel against the torch path: the same scales, and on the GPU the same bytes
    (``exact``). Triton's interpreter (the CPU) casts to e4m3 otherwise than the GPU and
    torch: it flushes values below 2^-6 to zero and has rounded 0.121 to 0.0625 where torch
    gives 0.125 (2026-12-07), so there the values are only checked to keep their sign and
    to lie within one binade (a factor of 2) of torch's, or below 2^-6 both."""
    from mega_moe.fp8_rows import _kernel_applies, quantize_rows_2d

    gen = torch.Generator().manual_seed(rows * cols)
    t = (torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 3, cols)).to(
        getattr(torch, dtype)
    ).to(device)  # fmt: skip
    assert _kernel_applies(t)
    got, want = quantize_rows_2d(t), quantize_rows(t)
    assert torch.equal(got.inv_scale, want.inv_scale)
    a = got.data.view(torch.uint8).int()
    b = want.data.view(torch.uint8).int()
    if exact:
        assert torch.equal(a, b)
        return
    x, y = got.data.float(), want.data.float()
    normal = (x.abs() >= 2.0**-6) & (y.abs() >= 2.0**-6)
    assert torch.equal((a >> 7)[normal], (b >> 7)[normal])  # the same sign
    ratio = (x / y)[normal]
    assert bool(((ratio >= 0.5) & (ratio <= 2.0)).all())
    assert bool(((x.abs() < 2.0**-5) | (y.abs() >= 2.0**-6)).all())


def test_row_kernel() -> None:
    """The kernel in a child process: interpreted on CPU, compiled on CUDA."""
    pytest.importorskip("triton")
    cuda = torch.cuda.is_available()
    code = (
        "import runpy\n"
        f"mod = runpy.run_path({__file__!r})\n"
        "for case in mod['KERNEL_CASES']:\n"
        f"    mod['check_kernel'](*case, {'cuda' if cuda else 'cpu'!r}, {cuda})\n"
        "print('ok')\n"
    )
    assert run_kernel_child(code).strip().endswith("ok")


def test_row_kernel_falls_back_where_it_does_not_apply() -> None:
    from mega_moe.fp8_rows import quantize_rows_2d

    t = torch.randn(4, 24)
    if os.environ.get("TRITON_INTERPRET") != "1":  # plain CPU: the torch path, bit for bit
        got, want = quantize_rows_2d(t), quantize_rows(t)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    wide = torch.randn(2, 4100)  # past one program's row: the torch path everywhere
    assert torch.equal(quantize_rows_2d(wide).inv_scale, quantize_rows(wide).inv_scale)
