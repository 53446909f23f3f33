"""assert_close_to_reference: rounding noise passes, a real defect fails, the message says where."""

from __future__ import annotations

import math

import pytest
import torch

from mega_parallel_grid.testing import MARGIN, assert_close_to_reference, rounding_bound

N = 64  # terms per element of the GEMM below


def _factors() -> tuple[torch.Tensor, torch.Tensor]:
    """Factors of a [32, 48] product of N terms per element (a weight gradient's shape)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, N, generator=g, dtype=torch.float64)
    return a, torch.randn(N, 48, generator=g, dtype=torch.float64)


def _partials(ranks: int) -> list[torch.Tensor]:
    a, b = _factors()
    return [a[:, r::ranks].float() @ b[r::ranks].float() for r in range(ranks)]


def test_reordered_sums_pass() -> None:
    a, b = _factors()
    ref = a.float() @ b.float()
    p = _partials(4)
    reordered = (p[3] + p[1]) + (p[2] + p[0])  # partial sums over 4 ranks, another order
    assert not torch.equal(reordered, ref)  # the rounding does differ
    assert_close_to_reference(reordered, ref, reduction_length=N, name="grad")
    # fp32 against the exact (fp64) product: fp32's unit roundoff applies
    assert_close_to_reference(ref, a @ b, reduction_length=N, name="fp32 vs fp64")


def test_rounding_noise_at_a_small_element_passes() -> None:
    """The qkv-bias-grad case: a small element carries the rounding of large terms."""
    ref = torch.tensor([18.0, 1e-3, -5.0])
    noisy = ref + torch.tensor([0.0, 2.1e-6, 0.0])  # 2e-3 relative at the small element
    with pytest.raises(AssertionError):  # an elementwise check fails on rounding alone
        torch.testing.assert_close(noisy, ref, rtol=1e-5, atol=1e-6)
    assert_close_to_reference(noisy, ref, reduction_length=24, name="bias grad")


@pytest.mark.parametrize("which", ["largest", "median"])
def test_one_element_off_by_1e_3_relative_fails(which: str) -> None:
    ref = sum(_partials(4), torch.zeros(32, 48))
    flat = ref.flatten().abs()
    index = int(flat.argmax()) if which == "largest" else int(flat.argsort()[flat.numel() // 2])
    broken = ref.clone().flatten()
    broken[index] *= 1 + 1e-3
    where = list(torch.unravel_index(torch.tensor(index), ref.shape))
    with pytest.raises(AssertionError, match=rf"grad: .* at \[{where[0]}, {where[1]}\]"):
        assert_close_to_reference(broken.view_as(ref), ref, reduction_length=N, name="grad")


def test_parallel_defects_fail() -> None:
    p = _partials(2)
    ref = p[0] + p[1]
    defects = {
        "missing all-reduce": p[0],  # one rank's partial sum only
        "counted twice": 2 * ref,
        "wrong 1/dp scale": ref / 2,
    }
    for what, actual in defects.items():
        with pytest.raises(AssertionError, match=what):
            assert_close_to_reference(actual, ref, reduction_length=N, name=what)


def test_message_names_tensor_error_bound_and_place() -> None:
    ref = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    bad = ref.clone()
    bad[1, 0] = 3.5
    bound = MARGIN * 2.0**-24 * math.sqrt(9) * 4.0
    assert rounding_bound(ref, reduction_length=9) == pytest.approx(bound)
    with pytest.raises(AssertionError) as info:
        assert_close_to_reference(bad, ref, reduction_length=9, name="fc1 weight grad")
    message = str(info.value)
    assert message.startswith("fc1 weight grad: max |actual - expected| = 0.5 at [1, 0]")
    assert f"rounding bound {bound:.3g}" in message and "sqrt(n = 9)" in message
    assert "1 of 4 elements over it" in message


def test_nan_shape_and_length() -> None:
    ref = torch.tensor([1.0, float("inf"), float("nan")])
    assert_close_to_reference(ref.clone(), ref, reduction_length=1, name="same specials")
    with pytest.raises(AssertionError, match="nan"):
        assert_close_to_reference(torch.tensor([float("nan"), 1.0]), torch.ones(2),
                                  reduction_length=1, name="nan")  # fmt: skip
    with pytest.raises(AssertionError, match=r"shape \(3,\) != reference \(2,\)"):
        assert_close_to_reference(torch.ones(3), torch.ones(2), reduction_length=1, name="x")
    with pytest.raises(ValueError, match=r"reduction_length \(0\) must be a positive"):
        assert_close_to_reference(torch.ones(2), torch.ones(2), reduction_length=0, name="x")
    assert_close_to_reference(torch.zeros(0), torch.zeros(0), reduction_length=1, name="empty")
