"""How close a parallel result must be to its single-process reference: a rounding bound.

A parallel run computes the same sums as one process, in another order (partial sums per
rank, then a collective; GEMMs of other shapes; another CPU's kernels, blocking and thread
count). In floating point that order is the only difference, so the bound follows from
the unit roundoff ``u`` (``2**-24 ≈ 6e-8`` in fp32, ``2**-53`` in fp64):

- a sum or dot product of ``n`` terms, evaluated in two orders, differs by at most about
  ``n · u · Σ|terms|``; the errors of the individual additions are nearly independent, so in
  practice the difference is about ``sqrt(n) · u · scale``, where ``scale`` is the size of
  the terms;
- a composed computation (layers, forward then backward, optimizer steps) chains such
  sums; their errors add, so ``n`` is the total length of the chained reductions that
  produce one element (a stated over-estimate is fine; the bound grows only as its root);
- the terms' scale is the tensor's: its largest magnitude, not each element's. A gradient
  element is a sum of terms that cancel, so a small element carries the rounding of large
  terms, and an elementwise relative check (``rtol`` with a tiny ``atol``) fails on rounding
  alone on some CPU. Elementwise relative checks are only valid for quantities not formed
  by cancellation (a loss, a norm, a sum of squares): for those, pass a scalar or a short
  tensor of like values, where the max-abs scale is the element's own.

So we require ``max |actual - expected| <= MARGIN · u · sqrt(n) · scale`` with
``scale = max |expected|`` unless the caller knows the terms are larger (pass ``scale``,
e.g. when a result is a sum of terms that cancel to a much smaller value, or when only an
update of known size carries rounding). ``MARGIN = 16``: across the contract tests on
AVX-512, AVX2 and the portable kernels with 1 and 2 threads the largest error seen is
about 1.2 · u · sqrt(n) · scale, and 6.3 in one case whose softmax exponentiates scores of
-141 (exp multiplies a relative rounding by its argument); 16 leaves a factor of 2.5 over
that case and over 10 over the rest. A real defect is far above it: a missing all-reduce,
a wrong 1/dp scale or a gradient counted twice moves elements by O(1) of the scale, while
the bound for n = 10**4 is 1e-4 of the scale in fp32, and a relative change of 1e-3 at the
largest element fails for any n < 10**6.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["MARGIN", "assert_close_to_reference", "rounding_bound"]

#: Multiple of ``u · sqrt(n) · scale`` allowed (see the module doc for the measured margin).
MARGIN = 16.0


def _unit_roundoff(dtype: torch.dtype) -> float:
    if not dtype.is_floating_point:
        return 0.0  # integers: exact
    return float(torch.finfo(dtype).eps) / 2


def rounding_bound(
    expected: Tensor,
    *,
    reduction_length: int,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
) -> float:
    """The largest ``|actual - expected|`` that float rounding explains (see the module doc).

    ``dtype`` (default ``expected``'s) sets the unit roundoff: pass the less precise one
    when an fp32 result is compared with an fp64 reference.
    """
    if reduction_length < 1:
        raise ValueError(f"reduction_length ({reduction_length}) must be a positive integer")
    u = _unit_roundoff(expected.dtype if dtype is None else dtype)
    return MARGIN * u * math.sqrt(reduction_length) * (_scale(expected) if scale is None else scale)


def _scale(expected: Tensor) -> float:
    """The largest finite magnitude of ``expected`` (0 for an empty or non-finite tensor)."""
    finite = expected.detach()[torch.isfinite(expected.detach())]
    return float(finite.abs().max()) if finite.numel() else 0.0


def assert_close_to_reference(
    actual: Tensor | float,
    expected: Tensor | float,
    *,
    reduction_length: int,
    name: str,
    scale: float | None = None,
) -> None:
    """Fail unless ``actual`` equals the reference ``expected`` up to reordered-sum rounding.

    ``reduction_length`` is ``n``, the number of terms summed into one element along the
    longest chain of sums that produce it; ``scale`` (default ``max |expected|``) is the
    size of those terms. The two may live on different devices; shapes must match; the
    unit roundoff is that of the less precise of the two dtypes. The message names the tensor, the largest
    error, the bound and where the error is.
    """
    e = torch.as_tensor(expected).detach()
    a = torch.as_tensor(actual).detach()
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape {tuple(a.shape)} != reference {tuple(e.shape)}")
    scale = _scale(e) if scale is None else scale
    coarse = max(a.dtype, e.dtype, key=_unit_roundoff)  # fp32 against an fp64 reference: fp32
    u = _unit_roundoff(coarse)
    bound = rounding_bound(e, reduction_length=reduction_length, scale=scale, dtype=coarse)
    a64, e64 = a.cpu().double(), e.cpu().double()
    same = (a64 == e64) | (a64.isnan() & e64.isnan())  # equal infinities and NaNs match
    err = torch.where(same, torch.zeros_like(a64), (a64 - e64).abs().nan_to_num(math.inf))
    if err.numel() == 0:
        return
    worst = int(err.argmax())
    worst_err = float(err.flatten()[worst])
    if worst_err <= bound:
        return
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
    over = int((err > bound).sum())
    raise AssertionError(
        f"{name}: max |actual - expected| = {worst_err:.3g} at {list(where)} "
        f"(actual {float(a64.flatten()[worst]):.9g}, expected {float(e64.flatten()[worst]):.9g}) "
        f"exceeds the rounding bound {bound:.3g} = {MARGIN:g} · u ({u:.3g}) "
        f"· sqrt(n = {reduction_length}) · scale ({scale:.3g}); "
        f"{over} of {err.numel()} elements over it"
    )
