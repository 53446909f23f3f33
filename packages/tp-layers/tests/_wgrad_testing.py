"""Run one module's backward fused and split (B, then W from the store) from the same inputs.

Shared by the split-backward tests of tp-layers, mega-moe and mega-models (the root
``pythonpath`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from mega_tp_layers import defer_weight_grads

#: a forward from fresh inputs: (output, the input leaves whose gradients are compared)
Forward = Callable[[], tuple[Tensor, dict[str, Tensor]]]


@dataclass
class SplitRun:
    """What the fused and the split backward gave."""

    fused_out: Tensor
    split_out: Tensor
    fused: dict[str, Tensor]
    """Every parameter's and input leaf's gradient after the fused backward."""
    split: dict[str, Tensor]
    """The same after the split backward's B and W."""
    early: set[str]
    """The parameters whose gradient accumulator ran in B (a gradient or not: a
    data-parallel wrapper's post-accumulate hook counts it as arrived), before W."""
    deferred: int
    """How many weight-gradient passes B left in the store."""


def _grads(module: nn.Module, leaves: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    for name, leaf in leaves.items():
        assert leaf.grad is not None, f"input {name} got no gradient"
        out[f"input {name}"] = leaf.grad.clone()
    return out


def fused_and_split(module: nn.Module, forward: Forward, grad_out: Tensor) -> SplitRun:
    """Backward of ``forward()`` fused, then inside ``defer_weight_grads`` with W after B."""
    module.zero_grad(set_to_none=True)
    fused_out, leaves = forward()
    fused_out.backward(grad_out)
    fused = _grads(module, leaves)
    module.zero_grad(set_to_none=True)
    arrived: list[str] = []
    handles = [
        p.register_post_accumulate_grad_hook(lambda _, n=n: arrived.append(n))  # type: ignore[misc]
        for n, p in module.named_parameters()
        if p.requires_grad  # a frozen parameter takes no hook (and no gradient)
    ]
    with defer_weight_grads() as store:
        split_out, leaves = forward()
    split_out.backward(grad_out)
    early = set(arrived) | {n for n, p in module.named_parameters() if p.grad is not None}
    deferred = len(store)
    arrived.clear()
    store.run()
    for handle in handles:
        handle.remove()
    late = {n for n, p in module.named_parameters() if p.requires_grad} - early
    assert sorted(arrived) == sorted(late), f"W accumulated {arrived}, not once each of {late}"
    assert len(store) == 0
    split = _grads(module, leaves)
    assert split.keys() == fused.keys(), (sorted(split), sorted(fused))
    return SplitRun(fused_out, split_out, fused, split, early, deferred)
