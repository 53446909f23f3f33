"""Row-wise FP8 operands of the experts' grouped GEMMs, and the 16-row padded layout they need.

An FP8 expert FFN (``MoEConfig(expert_fp8=True)``) multiplies e4m3 values with one fp32
scale per row of each operand along its non-contracted dimension: a token row of the
activations (or of the output gradient), an output row of each expert's weight. The scale
then factors out of every dot product, ``out[m, n] = sum_k qa[m, k] qb[n, k] * sa[m] sb[n]``,
which is what ``torch._scaled_grouped_mm`` computes on Hopper. ``scale = 448 / amax`` of the
row (e4m3's largest value over the row's largest magnitude), so nothing saturates.

A row that spans a dimension sharded over a group (expert tensor parallelism cuts the
experts' intermediate dimension) takes its amax all-reduced (max) over that group, so every
rank scales as one process would.

``torch._scaled_grouped_mm`` takes no group whose row count is not a multiple of 16 (on an
H100 a device-side assert, measured 2026-12-06). :class:`PaddedRows` lays each expert's
block out at a multiple of 16 rows with zero rows between; the last block absorbs the
slack up to a capacity that depends only on the row count and the number of experts, so
under ``torch.compile`` nothing is read on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from mega_moe._comm import Group, group_size
from mega_moe._gemm import _offsets
from mega_moe.wgrad_accum import _triton_enabled

__all__ = [
    "E4M3",
    "FP8_ROW_ALIGN",
    "ROW_KERNEL_MAX_COLS",
    "Fp8Rows",
    "PaddedRows",
    "aligned_rows",
    "padded_rows",
    "quantize_columns_transposed",
    "quantize_rows",
    "quantize_rows_2d",
]

E4M3 = torch.float8_e4m3fn
_FMAX = torch.finfo(E4M3).max
#: a row whose largest magnitude is below this is scaled as if it were this (zero rows)
_EPS = 1e-12
#: rows per expert block that ``torch._scaled_grouped_mm`` takes (16 bytes of fp8)
FP8_ROW_ALIGN = 16
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: the widest row the one-pass kernel holds in one program's registers (``_rowquant_triton``)
ROW_KERNEL_MAX_COLS = 4096


class Fp8Rows(NamedTuple):
    """e4m3 ``data [..., R, C]`` and one fp32 inverse scale per row, ``inv_scale [..., R]``."""

    data: Tensor
    inv_scale: Tensor

    def dequantize(self) -> Tensor:
        """The fp32 values these stand for."""
        return self.data.float() * self.inv_scale.unsqueeze(-1)


def _quantize(t: Tensor, dim: int, group: Group) -> tuple[Tensor, Tensor]:
    """``t`` in e4m3 with one scale per slice along ``dim`` (reduced away), and the
    inverse scales; ``group``: ``dim`` is this rank's shard of a dimension split over it."""
    t32 = t.detach().float()
    amax = t32.abs().amax(dim=dim)
    if group_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = _FMAX / amax.clamp(min=_EPS)
    data = (t32 * scale.unsqueeze(dim)).clamp(-_FMAX, _FMAX).to(E4M3)
    return data, scale.reciprocal()


def quantize_rows(t: Tensor, group: Group = None) -> Fp8Rows:
    """``t [..., R, C]`` in e4m3, one scale per row over its last dimension; ``group``: the
    last dimension is this rank's shard of a row split over the group."""
    return Fp8Rows(*_quantize(t, -1, group))


def _kernel_applies(t: Tensor) -> bool:
    if t.dim() != 2 or t.numel() == 0 or t.dtype not in _KERNEL_DTYPES:
        return False
    if t.shape[1] > ROW_KERNEL_MAX_COLS:
        return False
    return _triton_enabled(t.device)  # CUDA, or the interpreter on CPU for the tests


@torch.library.custom_op("mega_moe::quantize_rows", mutates_args=())
def _quantize_rows_op(t: Tensor) -> tuple[Tensor, Tensor]:
    t = t.contiguous()
    if not _kernel_applies(t):
        return _quantize(t, -1, None)
    from mega_moe._rowquant_triton import quantize_rows_into

    data = torch.empty(t.shape, dtype=E4M3, device=t.device)
    inv_scale = torch.empty(t.shape[0], dtype=torch.float32, device=t.device)
    quantize_rows_into(data, inv_scale, t, _FMAX, _EPS)
    return data, inv_scale


@_quantize_rows_op.register_fake
def _(t: Tensor) -> tuple[Tensor, Tensor]:
    return t.new_empty(t.shape, dtype=E4M3), t.new_empty(t.shape[0], dtype=torch.float32)


def quantize_rows_2d(t: Tensor, group: Group = None) -> Fp8Rows:
    """:func:`quantize_rows` of a 2-D ``t``, by one opaque one-pass kernel where it runs
    (CUDA with Triton, rows up to 4,096 wide, no group to reduce over).

    Under ``torch.compile`` the row amax fused into its producer became a two-pass loop
    over rows wider than 1,024 (Inductor's persistent-reduction limit), recomputing the
    producer in each pass: 0.27-0.40 ms a call on an H200 for ``deepseek-v3-3b``'s expert
    rows (2026-12-07). As an operator of its own the producer writes its bf16 output (which
    the weight gradient reads anyway) and the kernel reads each row once. The values are
    the torch path's (the same operations, IEEE-rounded; bitwise on an H100). Not the
    experts' default: swapped in by ``bench/fp8_expert_parts.py --part row-kernel``, it made
    ``deepseek-v3-3b``'s fp8 step slower on an H100 (993.5 against 945.4 ms, 2026-12-07;
    not yet profiled).
    """
    if group_size(group) > 1 or not _kernel_applies(t):
        return quantize_rows(t, group)
    data, inv_scale = _quantize_rows_op(t.detach())
    return Fp8Rows(data, inv_scale)


def quantize_columns_transposed(t: Tensor, group: Group = None) -> Fp8Rows:
    """``quantize_rows(t.transpose(-2, -1), group)``, bit for bit, made by passes that read
    ``t [..., R, C]`` along its contiguous last dimension: the amax down each column, the
    cast in ``t``'s layout, then a transposing copy of the one-byte values. (Reducing along
    the strided dimension of the transposed view ran at ~0.3 TB/s on an H200 under
    Inductor: 1.3 ms a call for a ``deepseek-v3-3b`` expert weight, 2026-12-07.)"""
    data, inv_scale = _quantize(t, -2, group)
    return Fp8Rows(data.transpose(-2, -1).contiguous(), inv_scale)


class PaddedRows(NamedTuple):
    """Where each row of an expert-major ``[M, ...]`` tensor goes in the padded layout."""

    dest: Tensor | None
    """``[M]`` int64: the padded row of each row (None: the rows are already so laid out)."""
    ends: Tensor
    """``[L]`` int32: the end row of each expert's padded block (the last one is
    ``capacity``); every block is a multiple of :data:`FP8_ROW_ALIGN` rows."""
    capacity: int
    """Rows of the padded layout."""

    def scatter(self, rows: Fp8Rows) -> Fp8Rows:
        """``[M, C]`` -> ``[capacity, C]``, zero rows (scale 1) in the padding."""
        if self.dest is None:
            return rows
        c = rows.data.shape[1]
        data = torch.zeros(self.capacity, c, dtype=torch.uint8, device=rows.data.device)
        data.index_copy_(0, self.dest, rows.data.view(torch.uint8))
        scale = torch.ones(self.capacity, dtype=rows.inv_scale.dtype, device=rows.data.device)
        scale.index_copy_(0, self.dest, rows.inv_scale)
        return Fp8Rows(data.view(E4M3), scale)

    def gather(self, padded: Tensor) -> Tensor:
        """``[capacity, C]`` -> ``[M, C]``: the rows :meth:`scatter` placed, in their order."""
        return padded if self.dest is None else padded.index_select(0, self.dest)


def aligned_rows(counts: list[int] | Tensor, m: int, device: torch.device) -> PaddedRows:
    """The layout of ``m`` rows whose blocks (``counts``) already are multiples of 16; host
    counts that are not are refused in one sentence (the GPU's grouped GEMM would assert)."""
    if not isinstance(counts, Tensor) and any(c % FP8_ROW_ALIGN for c in counts):
        raise ValueError(
            f"aligned expert rows need every count to be a multiple of {FP8_ROW_ALIGN}, got "
            f"{counts}; pass aligned=False to have the fp8 GEMMs pad them"
        )
    return PaddedRows(None, _offsets(counts, device), m)


def padded_rows(counts: list[int] | Tensor, m: int, device: torch.device) -> PaddedRows:
    """The padded layout of ``m`` expert-major rows, ``counts[l]`` of them for expert l.

    Host counts give the exact capacity (the sum of the padded blocks); device counts the
    static bound ``m + L * 15`` rounded up to 16, so nothing is read on the host.
    """
    align = FP8_ROW_ALIGN
    n = len(counts)
    if isinstance(counts, Tensor):
        capacity = -(-(m + n * (align - 1)) // align) * align
    else:
        capacity = sum(-(-c // align) * align for c in counts) if n else 0
    ends_in = _offsets(counts, device).long()  # host counts: copied up without a sync
    sizes = ends_in - torch.cat([ends_in.new_zeros(1), ends_in[:-1]])
    padded = torch.div(sizes + (align - 1), align, rounding_mode="floor") * align
    ends = torch.cumsum(padded, 0)
    shift = (ends - padded) - (ends_in - sizes)  # padded start - start
    expert = torch.repeat_interleave(torch.arange(n, device=device), sizes, output_size=m)
    dest = torch.arange(m, device=device) + shift[expert]
    ends = torch.cat([ends[:-1], ends.new_full((1,), capacity)])  # the last takes the slack
    return PaddedRows(dest, ends.to(torch.int32), capacity)
