# mypy: ignore-errors
"""The streaming kernel behind :mod:`mega_zero_optim.flat_adamw`: one Adam(W) step of a flat
segment and its low-precision copy in one pass.

One program per ``BLOCK`` elements: load the gradient (fp32, bf16 or fp16) and widen it,
load the fp32 master and both moments (fp32 or bf16, widened), update them in fp32 in the
order of torch's single-tensor Adam (decay, lerp of the mean, the variance, ``denom``,
``addcdiv``), store the master, the moments (rounded to nearest in their buffer's dtype)
and (``WRITE_LP``) the master rounded to the parameter's dtype. Square root and division
round to nearest, as torch's. With fp32 gradients and a bf16 copy an element moves 30
bytes (16 read, 14 written), 22 with bf16 moments, against 34 for torch's fused step and
a separate write-back. For fp32 moments the widening and the store's cast are no-ops
(Triton's cast returns a tensor of the same dtype as it is), so that case compiles to the
same code as before bf16 moments existed. Imported only when called, so the package
never needs triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mega_zero_optim.flat_adamw import SegmentStep, SegmentTensors

__all__ = ["adamw_segment"]

#: Elements a program: 4 KiB of each fp32 stream, 8 warps, each thread 4 elements a stream.
BLOCK = 1024


@triton.jit
def _adamw_kernel(
    grad_ptr,
    master_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    lp_ptr,
    n,
    grad_mul,
    decay,  # 1 - lr * weight_decay (AdamW) or weight_decay (Adam's L2 term)
    mean_weight,  # 1 - beta1, the weight of the lerp
    beta2,
    sq_weight,  # 1 - beta2
    bc2_sqrt,
    eps,
    neg_step_size,  # -lr / (1 - beta1 ** step)
    SCALE_GRAD: tl.constexpr,
    DECOUPLED: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    LERP_FROM_END: tl.constexpr,
    WRITE_LP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(grad_ptr + offs, mask=mask, eviction_policy="evict_first").to(tl.float32)
    p = tl.load(master_ptr + offs, mask=mask, eviction_policy="evict_first")
    m = tl.load(exp_avg_ptr + offs, mask=mask, eviction_policy="evict_first").to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, eviction_policy="evict_first").to(tl.float32)
    if SCALE_GRAD:
        g = g * grad_mul
    if HAS_DECAY:
        if DECOUPLED:
            p = p * decay
        else:
            g = g + decay * p
    # torch's lerp: start + w * (end - start) for w < 0.5, else end - (end - start) * (1 - w)
    if LERP_FROM_END:
        m = g - (g - m) * (1.0 - mean_weight)
    else:
        m = m + mean_weight * (g - m)
    v = v * beta2 + sq_weight * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + neg_step_size * tl.div_rn(m, denom)
    tl.store(master_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)
    if WRITE_LP:
        tl.store(lp_ptr + offs, p.to(lp_ptr.dtype.element_ty), mask=mask)


def adamw_segment(t: SegmentTensors, hp: SegmentStep) -> None:
    """One step of a contiguous segment (see :class:`~mega_zero_optim.flat_adamw.SegmentTensors`)."""
    n = t.master.numel()
    decoupled = hp.decoupled
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        t.grad,
        t.master,
        t.exp_avg,
        t.exp_avg_sq,
        t.master if t.low_precision is None else t.low_precision,
        n,
        hp.grad_mul,
        1.0 - hp.lr * hp.weight_decay if decoupled else hp.weight_decay,
        1.0 - hp.beta1,
        hp.beta2,
        1.0 - hp.beta2,
        hp.bias_correction2_sqrt,
        hp.eps,
        -hp.step_size,
        SCALE_GRAD=hp.grad_mul != 1.0,
        DECOUPLED=decoupled,
        HAS_DECAY=hp.weight_decay != 0,
        LERP_FROM_END=1.0 - hp.beta1 >= 0.5,
        WRITE_LP=t.low_precision is not None,
        BLOCK=BLOCK,
        num_warps=8,
    )
