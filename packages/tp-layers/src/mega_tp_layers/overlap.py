"""Collective matmul: the sequence-parallel collectives overlapped with the linear GEMMs.

Under sequence parallel a column layer all-gathers its input ``[s/tp, b, h]`` before its
GEMM and a row layer reduce-scatters its partial output ``[s, b, h]`` after it. Here each
collective runs as a ring over the tp group, one sequence chunk (``s/tp`` rows) per step,
through ``batch_isend_irecv`` to the two neighbours, and the GEMM is cut into the same
chunks:

- all-gather + GEMM (column forward; row backward's output-gradient gather and dgrad):
  the GEMM of the chunk in hand runs while the next chunk travels, the local chunk
  first; each chunk's result is written in place into its rows of the output.
- GEMM + reduce-scatter (row forward; column backward's dgrad): each step computes this
  rank's partial product for one peer's chunk and adds the running sum received from the
  previous rank, while the sum computed before it travels on; this rank's own chunk last.

Every transfer is launched before the GEMM that overlaps it and waited only where its
data is needed (on NCCL a wait is a stream dependency, not a host sync).

The chunk GEMMs are the layer's own: ``torch.mm`` / ``torch.addmm`` on row slices (the ops
that ``F.linear`` and its backward run on the whole tensor), or the FP8 GEMM of
``mega_tp_layers.fp8`` with the scale of the whole tensor: a local tensor is quantised
once, and a tensor being gathered takes its amax from one scalar max all-reduce, so every
chunk has the fp8 values of the unchunked GEMM, which also decides fp8 or fallback by
the whole GEMM's dimensions. The results therefore equal the non-overlapped layer's up to
the order in which the tp partial sums are added (bitwise for tp = 2 where a GEMM's row
slices round like the whole GEMM, as CPU BLAS does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Function
from torch.distributed import ProcessGroup

from mega_tp_layers._comm import (
    all_gather_dim0,
    all_reduce_max,
    group_rank,
    group_size,
    ring_shift,
)
from mega_tp_layers.fp8 import (
    Fp8Recipe,
    Fp8Tensor,
    fp8_gemm_fits,
    fp8_linear_wgrad,
    fp8_quantize,
    fp8_quantize_by_amax,
    scaled_gemm,
    shared_grad,
    warn_unaligned,
)

__all__ = [
    "all_gather_linear",
    "check_tp_comm_overlap",
    "linear_reduce_scatter",
    "ring_all_gather",
    "ring_reduce_scatter",
]


def check_tp_comm_overlap(
    owner: str, tp_comm_overlap: bool, sequence_parallel: bool, tp: int
) -> bool:
    """Whether the overlap is on; one sentence when it cannot apply."""
    if not tp_comm_overlap:
        return False
    if not sequence_parallel or tp == 1:
        raise ValueError(
            f"{owner} tp_comm_overlap=True overlaps the sequence-parallel all-gather and "
            f"reduce-scatter with the GEMMs, so it needs sequence_parallel=True and tp > 1 "
            f"(got sequence_parallel={sequence_parallel}, tp={tp}); turn tp_comm_overlap off "
            "or enable sequence parallel"
        )
    return True


def ring_all_gather(
    local: Tensor,
    group: ProcessGroup,
    on_chunk: Callable[[int, Tensor], None],
    *,
    keep: bool = False,
) -> Tensor | None:
    """All-gather ``local`` along dim 0 around a ring of ``group``, chunk by chunk.

    ``on_chunk(source_rank, chunk)`` gets each rank's ``[m, ...]`` chunk as soon as it is
    here: the local one first, while the first transfer is in flight, then each received
    one while the next travels. With ``keep`` the gathered ``[m * tp, ...]`` tensor is
    returned (chunks are received into it); otherwise two chunk buffers rotate and the
    result is None.
    """
    size, rank = group_size(group), group_rank(group)
    assert size > 1, "callers use the plain GEMM for a size-1 group"
    local = local.contiguous()
    m = local.shape[0]
    full: Tensor | None = None
    if keep:
        full = local.new_empty((m * size, *local.shape[1:]))
        full[rank * m : (rank + 1) * m].copy_(local)
    buffers = [] if keep else [torch.empty_like(local) for _ in range(min(2, size - 1))]
    chunk = local
    for step in range(size):
        source = (rank - step) % size
        works: list[dist.Work] = []
        recv = chunk
        if step < size - 1:
            nxt = (source - 1) % size  # the chunk the previous rank holds now
            recv = full[nxt * m : (nxt + 1) * m] if full is not None else buffers[step % 2]
            works = ring_shift(chunk, recv, group)
        on_chunk(source, chunk)  # overlaps the transfer of the next chunk
        for work in works:
            work.wait()
        chunk = recv
    return full


def ring_reduce_scatter(
    partial: Callable[[int], Tensor],
    group: ProcessGroup,
    *,
    before_last_wait: Callable[[], None] | None = None,
) -> Tensor:
    """Sum over the ranks of ``group`` of ``partial(rank)`` for this rank's chunk, in a ring.

    ``partial(d)`` returns this rank's contribution to rank ``d``'s chunk as a fresh
    contiguous tensor (it is sent, and the received sum is added into it). Peers' chunks
    come first, starting with the previous rank's: at each step the sum built so far
    travels to the next rank while the next partial is computed; this rank's own chunk is
    computed last, and ``before_last_wait`` runs while the last transfer is in flight.
    """
    size, rank = group_size(group), group_rank(group)
    assert size > 1, "callers use the plain GEMM for a size-1 group"
    acc = partial((rank - 1) % size)
    buffers = [torch.empty_like(acc) for _ in range(min(2, size - 1))]
    for step in range(1, size):
        recv = buffers[step % len(buffers)]
        works = ring_shift(acc, recv, group)  # the running sum of chunk rank - step
        nxt = partial((rank - 1 - step) % size)  # overlaps the transfer
        if step == size - 1 and before_last_wait is not None:
            before_last_wait()
        for work in works:
            work.wait()
        acc = nxt.add_(recv)  # [m, ...]: sum of step + 1 ranks' partials
    return acc


def _rows(a: Tensor | Fp8Tensor, index: int, m: int) -> Tensor | Fp8Tensor:
    """Rows ``[index * m, (index + 1) * m)`` of a tensor or of an fp8 tensor's data."""
    if isinstance(a, Fp8Tensor):
        return Fp8Tensor(a.data[index * m : (index + 1) * m], a.inv_scale)
    return a[index * m : (index + 1) * m]


class _ChunkGemm:
    """Row slices of one GEMM ``a @ b`` over ``rows`` rows, rounded as the whole GEMM is.

    ``forward``: ``a`` = input ``[M, in]``, ``b`` = ``weight.T`` (+ ``bias``);
    ``dgrad``: ``a`` = output gradient ``[M, out]``, ``b`` = ``weight``. With ``fp8`` and
    GEMM dims that qualify, ``weight`` is quantised once and ``a``'s slices with the scale
    of all of ``a``: quantise it whole (:meth:`quantise_whole`) when this rank holds it, or
    share the amax of a gathered ``a`` (:meth:`start_amax`, then :meth:`quantise`).
    """

    def __init__(
        self,
        kind: Literal["forward", "dgrad"],
        weight: Tensor,
        rows: int,
        fp8: Fp8Recipe | None,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        # group: the tp group the weight (and a whole-held ``a``) are shards over, so their
        # fp8 scales are the whole tensors'
        self.kind, self.weight, self.fp8, self.out_dtype, self.bias = (
            kind, weight, fp8, out_dtype, bias,
        )  # fmt: skip
        self.group = group
        self.b = weight.t() if kind == "forward" else weight  # [K, N]
        self.quantised = False
        self.a_dtype = torch.float8_e4m3fn
        if fp8 is not None:
            self.a_dtype = fp8.fwd_dtype if kind == "forward" else fp8.grad_format
            if kind == "forward":
                dims = (rows, weight.shape[1], weight.shape[0])
            else:
                dims = (weight.shape[0], weight.shape[1], rows)
            self.quantised = fp8_gemm_fits(*dims)
            if not self.quantised:
                warn_unaligned(kind, dims)
        self._bq: Fp8Tensor | None = None
        self._amax: Tensor | None = None
        self._amax_work: dist.Work | None = None
        self.a_inv_scale: Tensor | None = None

    def start_amax(self, local: Tensor, group: ProcessGroup) -> None:
        """Launch the max all-reduce of ``local``'s amax: the scale of the gathered ``a``."""
        if self.quantised:
            self._amax = local.detach().float().abs().amax()
            self._amax_work = all_reduce_max(self._amax, group, async_op=True)

    def quantise(self, a: Tensor) -> Fp8Tensor:
        """A slice of the gathered ``a`` in fp8, with the whole tensor's scale."""
        assert self.fp8 is not None and self._amax is not None, "start_amax comes first"
        if self._amax_work is not None:
            self._amax_work.wait()
            self._amax_work = None
        quantised = fp8_quantize_by_amax(a, self._amax, self.a_dtype, self.fp8.eps)
        self.a_inv_scale = quantised.inv_scale
        return quantised

    def quantise_whole(self, a: Tensor) -> Tensor | Fp8Tensor:
        """All of ``a`` (held by this rank) as the GEMM takes it: fp8 or as it is."""
        if not self.quantised:
            return a
        assert self.fp8 is not None
        return fp8_quantize(a, self.a_dtype, self.fp8.eps, self.group)

    def _weight_fp8(self) -> Fp8Tensor:
        if self._bq is None:
            assert self.fp8 is not None
            wq = fp8_quantize(self.weight, self.fp8.fwd_dtype, self.fp8.eps, self.group)
            # column-major [K, N], as _scaled_mm takes it, laid out once for all chunks
            data = wq.data.t() if self.kind == "forward" else wq.data.t().contiguous().t()
            self._bq = Fp8Tensor(data, wq.inv_scale)
        return self._bq

    def __call__(self, a: Tensor | Fp8Tensor, out: Tensor | None = None) -> Tensor:
        """``a @ b`` for a slice ``a`` of rows, written into ``out`` when given."""
        if self.fp8 is None:
            assert isinstance(a, Tensor)
            if self.bias is not None:
                return torch.addmm(self.bias, a, self.b, out=out)
            return torch.mm(a, self.b, out=out)
        if self.quantised:
            aq = a if isinstance(a, Fp8Tensor) else self.quantise(a)
            y = scaled_gemm(
                aq, self._weight_fp8(), self.out_dtype, self.fp8, forward=self.kind == "forward"
            )
        else:  # fp8's high-precision fallback for GEMMs whose dims do not qualify
            assert isinstance(a, Tensor)
            lhs = a if self.kind == "forward" else a.to(self.weight.dtype)
            y = (lhs @ self.b).to(self.out_dtype)
        if self.bias is not None:
            y = y + self.bias
        if out is None:
            return y
        return out.copy_(y)


class _AllGatherLinear(Function):
    """fwd: ring all-gather dim 0 overlapped with the GEMM · bwd: dgrad GEMM overlapped with a ring reduce-scatter"""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        group: ProcessGroup,
        fp8: Fp8Recipe | None,
    ) -> Tensor:
        ctx.group, ctx.fp8 = group, fp8
        ctx.save_for_backward(x, weight)  # only the local rows, as without the overlap
        m, size = x.shape[0], group_size(group)
        gemm = _ChunkGemm("forward", weight, m * size, fp8, x.dtype, bias, group)
        gemm.start_amax(x, group)
        out = x.new_empty((m * size, weight.shape[0]))  # [s*b, out/tp]

        def on_chunk(source: int, chunk: Tensor) -> None:
            gemm(chunk, out[source * m : (source + 1) * m])  # [m, h] -> its rows of out

        ring_all_gather(x, group, on_chunk)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        group: ProcessGroup = ctx.group
        fp8: Fp8Recipe | None = ctx.fp8
        total, gather = x, None
        if need_w:  # the gathered input for wgrad, overlapped with the dgrad ring
            total, gather = all_gather_dim0(x, group, async_op=True)
        g8: Tensor | Fp8Tensor = grad  # [s*b, out/tp]
        if fp8 is not None and (need_x or need_w):  # quantised once for dgrad and wgrad
            g8 = shared_grad(grad, weight.shape[1], fp8, group)  # a shard of the gradient
        result: dict[str, Tensor] = {}

        def weight_grads() -> None:
            if gather is not None:
                gather.wait()
            if need_w and fp8 is not None:
                result["w"] = fp8_linear_wgrad(g8, total, fp8, out_dtype=weight.dtype)
            elif need_w:
                result["w"] = grad.t().matmul(total)
            if need_b:
                result["b"] = grad.sum(dim=0)

        grad_input = None
        if need_x:
            m = x.shape[0]
            gemm = _ChunkGemm("dgrad", weight, grad.shape[0], fp8, x.dtype, group=group)
            grad_input = ring_reduce_scatter(
                lambda dest: gemm(_rows(g8, dest, m)),  # [m, out/tp] -> [m, h], partial
                group,
                before_last_wait=weight_grads if need_w or need_b else None,
            )
        else:
            weight_grads()
        return grad_input, result.get("w"), result.get("b"), None, None


class _LinearReduceScatter(Function):
    """fwd: GEMM overlapped with a ring reduce-scatter along dim 0 · bwd: ring all-gather overlapped with the dgrad GEMM"""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, group: ProcessGroup, fp8: Fp8Recipe | None
    ) -> Tensor:
        ctx.group, ctx.fp8 = group, fp8
        ctx.save_for_backward(x, weight)
        rows, size = x.shape[0], group_size(group)
        m = rows // size
        gemm = _ChunkGemm("forward", weight, rows, fp8, x.dtype, group=group)
        xa = gemm.quantise_whole(x)  # [s*b, in/tp]
        # [m, in/tp] -> [m, out] per destination rank, summed over tp around the ring
        return ring_reduce_scatter(lambda dest: gemm(_rows(xa, dest, m)), group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        group: ProcessGroup = ctx.group
        fp8: Fp8Recipe | None = ctx.fp8
        m, rows = grad.shape[0], x.shape[0]
        gemm = _ChunkGemm("dgrad", weight, rows, fp8, x.dtype, group=group)
        gemm.start_amax(grad, group)
        grad_input = x.new_empty(x.shape) if need_x else None  # [s*b, in/tp]
        g8_full = None
        if gemm.quantised and need_w:  # the gathered gradient in fp8, for wgrad
            g8_full = grad.new_empty((rows, grad.shape[1]), dtype=gemm.a_dtype)

        def on_chunk(source: int, chunk: Tensor) -> None:
            a: Tensor | Fp8Tensor = gemm.quantise(chunk) if gemm.quantised else chunk
            if g8_full is not None and isinstance(a, Fp8Tensor):
                g8_full[source * m : (source + 1) * m].copy_(a.data)
            if grad_input is not None:
                gemm(a, grad_input[source * m : (source + 1) * m])  # [m, out] -> [m, in/tp]

        full = ring_all_gather(grad, group, on_chunk, keep=need_w)
        grad_weight = None
        if need_w:
            assert full is not None  # [s*b, out]
            if fp8 is None:
                grad_weight = full.t().mm(x)
            else:
                g: Tensor | Fp8Tensor = full
                if g8_full is not None:
                    assert gemm.a_inv_scale is not None
                    g = Fp8Tensor(g8_full, gemm.a_inv_scale)
                grad_weight = fp8_linear_wgrad(g, x, fp8, out_dtype=weight.dtype, x_group=group)
        return grad_input, grad_weight, None, None


def all_gather_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    tp_group: ProcessGroup,
    fp8: Fp8Recipe | None = None,
) -> Tensor:
    """``all_gather(x) @ weight.T + bias`` with the sequence all-gather overlapped, chunk by chunk.

    ``[s/tp, b, in] -> [s, b, out/tp]`` over ``tp_group`` (more than one rank); backward
    overlaps the input gradient's reduce-scatter with its GEMM.
    """
    flat = x.reshape(-1, x.shape[-1])  # [s/tp, b, in] -> [s/tp*b, in]
    out: Tensor = _AllGatherLinear.apply(flat, weight, bias, tp_group, fp8)
    lead = (x.shape[0] * group_size(tp_group), *x.shape[1:-1])
    return out.view(*lead, weight.shape[0])  # [s*b, out/tp] -> [s, b, out/tp]


def linear_reduce_scatter(
    x: Tensor, weight: Tensor, *, tp_group: ProcessGroup, fp8: Fp8Recipe | None = None
) -> Tensor:
    """``reduce_scatter(x @ weight.T)`` along the sequence, overlapped chunk by chunk.

    ``[s, b, in/tp] -> [s/tp, b, out]`` summed over ``tp_group`` (more than one rank; ``s``
    divisible by it); backward overlaps the output gradient's all-gather with its GEMM.
    """
    flat = x.reshape(-1, x.shape[-1])  # [s, b, in/tp] -> [s*b, in/tp]
    out: Tensor = _LinearReduceScatter.apply(flat, weight, tp_group, fp8)
    lead = (x.shape[0] // group_size(tp_group), *x.shape[1:-1])
    return out.view(*lead, weight.shape[0])  # [s/tp*b, out] -> [s/tp, b, out]
