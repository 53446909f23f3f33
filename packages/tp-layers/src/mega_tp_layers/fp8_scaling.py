"""Row-wise and block-wise FP8 scaling: one scale per row, or per 1x128 / 128x128 tile.

``Fp8Recipe(scaling="row")`` (torchao's "rowwise") scales every GEMM operand per row along
its non-contracted dimension, so the scale factors out of each dot product:
``(q_a @ q_b) * s_a[M, 1] * s_b[1, N]``. ``scaling="block"`` (DeepSeek-V3) scales
activations and gradients per 1x128 tile along the contracted dimension and weights per
128x128 block; a scale is then constant over one 128-wide K block of the GEMM, and the GEMM
is ``sum_kb (q_a[:, kb] @ q_b[kb, :]) * s_a[:, kb] * s_b[kb, :]``, each K block's fp32
partial product promoted and scaled on its own (DeepGEMM's two-level accumulation). The
tiles of each GEMM (``y = x W^T``; contracted dimension last in the operand's name):

==========  ===============================  =================================
GEMM        row                              block
==========  ===============================  =================================
forward     x per token, W per output row    x 1x128 along K, W 128x128
dgrad       dy per token, W per input col    dy 1x128 along N, W 128x128
wgrad       dy per channel, x per input col  dy and x 128x1 (128 tokens, 1 ch.)
==========  ===============================  =================================

so dgrad quantises W again along its other axis (row; block reuses the same blocks) and the
wgrad GEMM quantises dy and x again along the tokens: each GEMM's operands are quantised
from the high-precision tensors (the forward input is kept in its own dtype, not in fp8).
A K (or token) dimension that is not a multiple of 128 gets a last, partial block with its
own scale.

Tensor parallelism: a shard is passed as :class:`Fp8Shard` (group, dim). A row scale that
spans a sharded dimension takes its amax all-reduced (max) over the group (one ``[rows]``
all-reduce), so every rank scales as one process would; a tile of 1 along the shard is
local; a 128-wide tile along a shard is local when the shard is a multiple of 128 (the
layers check this at construction, :func:`check_fp8_layout`; elsewhere it is checked when
quantising).

On CUDA, row-wise GEMMs run ``torch._scaled_mm`` with ``[M, 1]`` / ``[1, N]`` fp32 scales
(bf16 output); block-wise GEMMs run ``torch.nn.functional.scaled_mm`` with
``ScalingType.BlockWise1x128`` / ``BlockWise128x128`` where this torch has it (sm90, CUDA
12.9+, K a multiple of 128), else the exact emulation on the GPU with one warning. On the
H200 (torch 2.11, 2026-12-01) eager row-wise trained like bf16 and the block-wise forward
ran. Compiled, row-wise first gave zero gradients (a no-op cast on a GEMM result, see
:func:`as_dtype`); since that fix (an H100, torch 2.11, 2026-12-06) every recipe's compiled
layer gives eager's gradients. CPU tests see the exact emulation: the same fp8 values
widened to fp32, the same scales.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from mega_tp_layers._comm import all_reduce_max, group_size

if TYPE_CHECKING:
    from mega_tp_layers.fp8 import Fp8Recipe

__all__ = [
    "BLOCK",
    "SCALINGS",
    "Fp8Shard",
    "Fp8Tiles",
    "as_dtype",
    "check_fp8_layout",
    "quantize_tiles",
    "tiled_gemm",
]

#: The recipes of ``Fp8Recipe.scaling``.
SCALINGS = ("tensor", "row", "block")
#: Tile edge of the block-wise recipe (DeepSeek-V3's 1x128 and 128x128).
BLOCK = 128
#: A tile size that spans the whole dimension (row-wise along it).
WHOLE = 0


class Fp8Shard(NamedTuple):
    """An operand that is this rank's shard of a tensor split along ``dim`` over ``group``."""

    group: ProcessGroup
    dim: int


class Fp8Tiles(NamedTuple):
    """fp8 ``data`` ``[R, C]`` with one fp32 inverse scale per ``tile`` (``[ceil(R/tr), ceil(C/tc)]``)."""

    data: Tensor
    inv_scale: Tensor
    tile: tuple[int, int]

    def expanded_scale(self) -> Tensor:
        """The inverse scale of every element, ``[R, C]``."""
        (rows, cols), (tr, tc) = self.data.shape, self.tile
        s = self.inv_scale.repeat_interleave(tr, dim=0)[:rows]
        return s.repeat_interleave(tc, dim=1)[:, :cols]

    def dequantize(self) -> Tensor:
        """The fp32 values this tensor stands for."""
        return self.data.float() * self.expanded_scale()

    def t(self) -> Fp8Tiles:
        """The transpose (data, scales and tile)."""
        return Fp8Tiles(self.data.t(), self.inv_scale.t(), (self.tile[1], self.tile[0]))


def _shard_dim(shard: ProcessGroup | Fp8Shard | None, what: str) -> Fp8Shard | None:
    if shard is None:
        return None
    if isinstance(shard, Fp8Shard):
        return shard if group_size(shard.group) > 1 else None
    if group_size(shard) == 1:
        return None
    raise ValueError(
        f"row- and block-wise fp8 scaling needs to know which dim of {what} is sharded over "
        "its group; pass Fp8Shard(group, dim) instead of the bare group"
    )


def quantize_tiles(
    x: Tensor,
    dtype: torch.dtype,
    eps: float,
    tile: tuple[int, int],
    shard: ProcessGroup | Fp8Shard | None = None,
    what: str = "the operand",
) -> Fp8Tiles:
    """2-D ``x`` in ``dtype`` with one scale per ``tile`` (an edge of 0: the whole dim).

    ``scale = fp8_max / max(amax, eps)`` per tile, as tensor-wise scaling does per tensor;
    ``shard``: ``x`` is a shard (see the module doc for when its amax is reduced).
    """
    x32 = x.detach().float()
    rows, cols = x32.shape
    tr, tc = (e if e != WHOLE else n for e, n in zip(tile, (rows, cols), strict=True))
    sharded = _shard_dim(shard, what)
    if sharded is not None and tile[sharded.dim] not in (1, WHOLE):
        local = x32.shape[sharded.dim]
        if local % tile[sharded.dim]:
            raise ValueError(
                f"block-wise fp8 scaling of {what} sharded along dim {sharded.dim} needs the "
                f"shard ({local}) to be a multiple of {tile[sharded.dim]}; choose sizes whose tp "
                "shards are multiples of it, or fp8 scaling 'row' or 'tensor'"
            )
    nr, nc = math.ceil(rows / tr), math.ceil(cols / tc)
    padded = F.pad(x32, (0, nc * tc - cols, 0, nr * tr - rows))  # zeros: no larger amax
    view = padded.view(nr, tr, nc, tc)
    amax = view.abs().amax(dim=(1, 3))  # [nr, nc]
    if sharded is not None and tile[sharded.dim] == WHOLE:
        all_reduce_max(amax, sharded.group)  # the row spans every rank's shard
    fmax = torch.finfo(dtype).max
    scale = fmax / amax.clamp(min=eps)
    q = (view * scale[:, None, :, None]).clamp(-fmax, fmax).to(dtype)
    data = q.view(nr * tr, nc * tc)[:rows, :cols]
    return Fp8Tiles(data, scale.reciprocal(), (tr, tc))


def _k_block(a: Fp8Tiles, b: Fp8Tiles) -> int:
    k = a.data.shape[1]
    ka, kb = a.tile[1], b.tile[0]
    assert ka == kb and (ka in (k, BLOCK)), f"K tiles {ka} and {kb} of a K={k} GEMM"
    return ka


def emulated_tiled_gemm(a: Fp8Tiles, b: Fp8Tiles) -> Tensor:
    """fp32 ``sum_kb (q_a[:, kb] @ q_b[kb, :]) * s_a[:, kb] * s_b[kb, :]``, ``[M, N]``."""
    (m, k), n = a.data.shape, b.data.shape[1]
    kblk = _k_block(a, b)
    s_a = a.inv_scale.repeat_interleave(a.tile[0], dim=0)[:m]  # [M, KB]
    s_b = b.inv_scale.repeat_interleave(b.tile[1], dim=1)[:, :n]  # [KB, N]
    qa, qb = a.data.float(), b.data.float()
    out: Tensor | None = None  # no in-place sum: see as_dtype (torch 2.11's Dynamo)
    for i, start in enumerate(range(0, k, kblk)):
        part = qa[:, start : start + kblk] @ qb[start : start + kblk]  # exact products
        term = part * (s_a[:, i : i + 1] * s_b[i : i + 1, :])
        out = term if out is None else out + term
    assert out is not None, f"a K={k} GEMM has no K block"
    return out


def tiled_gemm(
    a: Fp8Tiles, b: Fp8Tiles, out_dtype: torch.dtype, recipe: Fp8Recipe, *, forward: bool
) -> Tensor:
    """``dequant(a) @ dequant(b)`` for row- or block-scaled ``a`` ``[M, K]``, ``b`` ``[K, N]``."""
    from mega_tp_layers.fp8 import fp8_gemm_supported

    device = a.data.device
    fast = forward and recipe.fast_accum_forward
    if recipe.emulated_on(device):
        return as_dtype(emulated_tiled_gemm(a, b), out_dtype)
    if not fp8_gemm_supported(device):
        raise ValueError(
            f"Fp8Recipe(emulate=False) needs a CUDA device of compute capability 8.9 or newer "
            f"for torch._scaled_mm, but the tensors are on {device}; use emulate=None (auto)"
        )
    if recipe.scaling == "row":
        return _row_scaled_mm(a, b, out_dtype, fast)
    if not _blockwise_available(a.data.shape[1], device):
        _warn_emulated_blocks(torch.__version__)
        return as_dtype(emulated_tiled_gemm(a, b), out_dtype)
    return _block_scaled_mm(a, b, out_dtype, fast)


def _row_scaled_mm(a: Fp8Tiles, b: Fp8Tiles, out_dtype: torch.dtype, fast: bool) -> Tensor:
    """``torch._scaled_mm`` with ``[M, 1]`` and ``[1, N]`` scales."""
    out: Tensor = torch._scaled_mm(
        a.data.contiguous(),
        b.data.t().contiguous().t(),  # column-major
        scale_a=_dense(a.inv_scale),  # [M, 1]
        scale_b=_dense(b.inv_scale),  # [1, N]
        out_dtype=torch.bfloat16,  # row-wise scaling gives bf16 only
        use_fast_accum=fast,
    )
    return as_dtype(out, out_dtype)


def as_dtype(out: Tensor, dtype: torch.dtype) -> Tensor:
    """``out`` in ``dtype``, never through a no-op ``.to``: torch 2.11's Dynamo, tracing
    ``_Fp8Linear`` whose GEMM ended in ``out.to(out.dtype)``, gave its backward zeros for the
    output gradient (row-wise FP8's zero dx and dw under ``torch.compile`` on the GPU; on CPU
    under 2.11 the emulated GEMMs of every scaling in fp32, 2026-12-06). Every GEMM result
    of the FP8 paths goes through this."""
    return out if out.dtype == dtype else out.to(dtype)


def _dense(scale: Tensor) -> Tensor:
    """``scale`` (``[M, 1]`` or ``[1, N]``, dense in memory) with row-major strides, as a
    view: a transposed ``[M, 1]`` counts as contiguous to ``.contiguous()`` but carries
    stride ``(1, M)``, which ``_scaled_mm`` refuses on CPU."""
    return scale.reshape(-1).view(scale.shape)


def _blockwise_available(k: int, device: torch.device) -> bool:
    if not hasattr(F, "ScalingType") or k % BLOCK:
        return False
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.cuda.get_device_capability(device)[0] == 9 and cuda >= (12, 9)


@functools.cache
def _warn_emulated_blocks(version: str) -> None:
    warnings.warn(
        f"fp8 block-wise GEMMs run emulated (fp32 matmuls) on this GPU: torch {version} "
        "offers no torch.nn.functional.scaled_mm with ScalingType.BlockWise1x128 here (it "
        "needs sm90, CUDA 12.9+ and K a multiple of 128)",
        stacklevel=3,
    )


def _block_scale(t: Fp8Tiles, operand: str) -> tuple[Tensor, object]:
    """The scale in the layout ``scaled_mm`` reads, and its ``ScalingType`` (from torch's
    own samples: 1x128 scales outer-dim-major, 128x128 K-padded to 4; torch 2.11 on the H200
    took these layouts for the forward and the dgrad, 2026-12-01)."""
    st = F.ScalingType
    s = t.inv_scale
    if operand == "a":  # [M, K] tiles (1, 128): scale [M, KB], M-major
        return s.t().contiguous().t(), st.BlockWise1x128
    if t.tile == (BLOCK, BLOCK):  # b [K, N]: scale [KB, NB]
        kb = s.shape[0]
        padded = F.pad(s.t(), (0, -kb % 4))  # [NB, KB padded to 4]
        return padded.contiguous().t(), st.BlockWise128x128
    return s.contiguous().t(), st.BlockWise1x128  # b tiles (128, 1): [KB, N] as [N, KB]


def _block_scaled_mm(a: Fp8Tiles, b: Fp8Tiles, out_dtype: torch.dtype, fast: bool) -> Tensor:
    """``F.scaled_mm`` with DeepSeek-style block scales."""
    # cuBLAS has no fast accumulation with a 128x128-scaled operand (torch 2.11 refuses it:
    # "scaled_gemm doesn't support fast accum with 128x128 blockwise scaling")
    fast = fast and (BLOCK, BLOCK) not in (a.tile, b.tile)
    scale_a, recipe_a = _block_scale(a, "a")
    scale_b, recipe_b = _block_scale(b, "b")
    out: Tensor = F.scaled_mm(
        a.data.contiguous(),
        b.data.t().contiguous().t(),
        scale_a,
        recipe_a,  # type: ignore[arg-type]
        scale_b,
        recipe_b,  # type: ignore[arg-type]
        output_dtype=torch.bfloat16,
        use_fast_accum=fast,
    )
    return as_dtype(out, out_dtype)


def operand_tile(scaling: str, contracted: int, weight: bool) -> tuple[int, int]:
    """The tile of a GEMM operand whose dim ``contracted`` is summed over (module table)."""
    along = WHOLE if scaling == "row" else BLOCK
    across = BLOCK if scaling == "block" and weight else 1
    return (along, across) if contracted == 0 else (across, along)


def check_fp8_layout(
    owner: str,
    recipe: Fp8Recipe | None,
    tp: int,
    shard: tuple[str, int],
    tp_comm_overlap: bool,
) -> None:
    """A row/block recipe fits the layer: no overlap rings, block shards multiples of 128;
    delayed scaling (``amax_history``) and ``cache_weights`` without the overlap rings too."""
    if recipe is not None and recipe.amax_history and tp_comm_overlap:
        raise ValueError(
            f"{owner} tp_comm_overlap=True scales by the current amax only, not "
            f"Fp8Recipe(amax_history={recipe.amax_history}); turn the overlap off or use "
            "amax_history=0"
        )
    if recipe is not None and recipe.cache_weights and tp_comm_overlap:
        raise ValueError(
            f"{owner} tp_comm_overlap=True quantises the weight in its rings, not from "
            "Fp8Recipe(cache_weights=True)'s cache; turn the overlap off or use "
            "cache_weights=False"
        )
    if recipe is None or recipe.scaling == "tensor":
        return
    if tp_comm_overlap:
        raise ValueError(
            f"{owner} tp_comm_overlap=True runs tensor-wise fp8 only, not "
            f"Fp8Recipe(scaling={recipe.scaling!r}); turn the overlap off or use scaling='tensor'"
        )
    label, size = shard
    if recipe.scaling == "block" and tp > 1 and size % BLOCK:
        raise ValueError(
            f"{owner} with block-wise fp8 at tp {tp} needs {label} ({size}) to be a multiple "
            f"of {BLOCK}, so no 128-wide scaling block straddles two ranks; choose sizes that "
            "are, or Fp8Recipe(scaling='row')"
        )
