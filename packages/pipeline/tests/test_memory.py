"""Freeing a sent output keeps its graph: backward from it gives the same gradients."""

from __future__ import annotations

from typing import cast

import pytest
import torch
from torch import Tensor, nn

from mega_pipeline.memory import backward_from, deallocate_output, is_deallocated


@pytest.mark.parametrize("ends_in", ["linear", "tanh"])
def test_backward_from_freed_output_matches(ends_in: str) -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)]
    if ends_in == "tanh":  # tanh saves its output: autograd keeps its own reference
        layers.append(nn.Tanh())
    model = nn.Sequential(*layers)
    x = torch.randn(4, 3, 16, requires_grad=True)
    grad = torch.randn(4, 3, 16)

    model(x).backward(grad)
    expected = [cast(Tensor, p.grad).clone() for p in model.parameters()]
    expected_x = cast(Tensor, x.grad).clone()
    model.zero_grad()
    x.grad = None

    out = model(x)
    deallocate_output(out)
    assert is_deallocated(out)
    assert out.shape == (4, 3, 16) and out.grad_fn is not None
    assert out.untyped_storage().nbytes() == out.element_size()
    backward_from(out, grad)
    # the same operations on the same values: identical results
    for p, e in zip(model.parameters(), expected, strict=True):
        assert torch.equal(cast(Tensor, p.grad), e)
    assert torch.equal(cast(Tensor, x.grad), expected_x)


def test_views_and_scalars_are_left_alone() -> None:
    base = torch.randn(4, 4, requires_grad=True) * 2
    view = base[:2]
    deallocate_output(view)
    assert not is_deallocated(view) and view.untyped_storage().nbytes() == 64
    loss = base.sum()
    deallocate_output(loss)
    backward_from(loss, None)
