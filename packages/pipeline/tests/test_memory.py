"""Freeing a sent output releases its storage and keeps its graph: backward gives the same grads.

Outputs that are views (of a 2-D matrix product reshaped back to [s, b, h], as nn.Linear
returns on some torch versions) are covered explicitly, so the test does not depend on
what the installed torch's nn.Linear returns.
"""

from __future__ import annotations

import weakref
from typing import cast

import pytest
import torch
from torch import Tensor, nn

from mega_pipeline.memory import backward_from, deallocate_output, is_deallocated, make_viewless


class _ViewOut(nn.Module):
    """A Linear applied to the flattened tokens, its 2-D result viewed back as [s, b, h]."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        s, b, h = x.shape
        y: Tensor = self.linear(x.reshape(s * b, h))  # [s*b, h]
        return y.view(s, b, -1)  # [s*b, h] -> [s, b, h]: a view of the 2-D result


def _model(ends_in: str) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 16), nn.Tanh()]
    if ends_in == "view":
        layers.append(_ViewOut(16))
    else:
        layers.append(nn.Linear(16, 16))
    if ends_in == "tanh":  # tanh saves its output: autograd keeps its own reference
        layers.append(nn.Tanh())
    return nn.Sequential(*layers)


@pytest.mark.parametrize("ends_in", ["linear", "view", "tanh"])
def test_backward_from_freed_output_matches(ends_in: str) -> None:
    model = _model(ends_in)
    x = torch.randn(4, 3, 16, requires_grad=True)
    grad = torch.randn(4, 3, 16)

    model(x).backward(grad)
    expected = [cast(Tensor, p.grad).clone() for p in model.parameters()]
    expected_x = cast(Tensor, x.grad).clone()
    model.zero_grad()
    x.grad = None

    out = model(x)
    if ends_in == "view":
        assert out._base is not None  # the case a plain "skip views" would never free
    storage = weakref.ref(out.untyped_storage())
    assert storage() is not None
    out = deallocate_output(out)  # the view (if any) is dropped here
    assert is_deallocated(out) and out._base is None
    assert out.shape == (4, 3, 16) and out.grad_fn is not None
    assert out.untyped_storage().nbytes() == out.element_size()
    # the memory is really released, unless autograd saved the output for backward
    assert (storage() is None) == (ends_in != "tanh")
    backward_from(out, grad)
    # the same operations on the same values: identical results
    for p, e in zip(model.parameters(), expected, strict=True):
        assert torch.equal(cast(Tensor, p.grad), e)
    assert torch.equal(cast(Tensor, x.grad), expected_x)


def test_viewless_alias_shares_storage_and_passes_gradients() -> None:
    leaf = torch.randn(4, 4, requires_grad=True)
    base = leaf * 2
    view = base[:2]
    alias = make_viewless(view)
    assert alias._base is None and alias.data_ptr() == view.data_ptr()
    assert torch.equal(alias, view) and alias.stride() == view.stride()
    grad = torch.randn(2, 4)
    alias.backward(grad)
    assert torch.equal(cast(Tensor, leaf.grad), torch.cat([grad * 2, torch.zeros(2, 4)]))
    plain = torch.randn(3)
    assert make_viewless(plain) is plain and make_viewless(base) is base


def test_a_view_of_a_live_base_frees_only_the_alias() -> None:
    """The base is still referenced elsewhere: it keeps its values; backward is unchanged."""
    leaf = torch.randn(4, 4, requires_grad=True)
    base = leaf * 2
    values = base.detach().clone()
    kept = deallocate_output(base[:2])
    assert is_deallocated(kept) and kept.shape == (2, 4)
    assert base.untyped_storage().nbytes() == 64 and torch.equal(base.detach(), values)
    backward_from(kept, torch.ones(2, 4))
    assert torch.equal(
        cast(Tensor, leaf.grad), torch.cat([torch.full((2, 4), 2.0), torch.zeros(2, 4)])
    )


def test_scalars_are_left_alone() -> None:
    loss = (torch.randn(4, 4, requires_grad=True) * 2).sum()
    assert deallocate_output(loss) is loss and not is_deallocated(loss)
    backward_from(loss, None)
