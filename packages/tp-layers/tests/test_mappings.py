"""Each mapping does its collective forward and its dual backward; size-1 groups are free.

Values are small integers in fp32, so every sum is exact: equality is asserted exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_tp_layers import (
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
)

S, B, H = 12, 2, 12


def _run(fn: Callable[[Tensor], Tensor], x: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """(output, input gradient) of ``fn`` at ``x`` for upstream gradient ``grad``."""
    x = x.clone().requires_grad_()
    out = fn(x)
    out.backward(grad)
    assert x.grad is not None
    return out.detach(), x.grad


def _equal(actual: Tensor, expected: Tensor, what: str) -> None:
    assert torch.equal(actual.cpu(), expected.cpu()), what


def _check_mappings(tp: int) -> None:
    g: ProcessGroup = init_process_groups(ParallelConfig(tp=tp)).tp
    r, dev = dist.get_rank(g), rank_device()
    # per-rank tensors: rank r holds (r+1) * base, so sums over ranks are (tp(tp+1)/2) * base
    base = torch.arange(S * B * H, dtype=torch.float32).reshape(S, B, H) % 7
    mine = (base * (r + 1)).to(dev)
    total = base * (tp * (tp + 1) // 2)
    full = base.to(dev)

    out, grad = _run(lambda x: copy_to_tp_region(x, g), full, mine)
    _equal(out, base, "copy fwd: identity")
    _equal(grad, total, "copy bwd: all-reduce")

    out, grad = _run(lambda x: reduce_from_tp_region(x, g), mine, full)
    _equal(out, total, "reduce fwd: all-reduce")
    _equal(grad, base, "reduce bwd: identity")

    last = base.chunk(tp, dim=-1)[r]
    out, grad = _run(lambda x: scatter_to_tp_region(x, g), full, last.to(dev))
    _equal(out, last, "scatter fwd: own slice of the last dim")
    _equal(grad, base, "scatter bwd: all-gather of the last dim")

    out, grad = _run(lambda x: gather_from_tp_region(x, g), last.to(dev), full)
    _equal(out, base, "gather fwd: all-gather of the last dim")
    _equal(grad, last, "gather bwd: own slice")

    seq = base.chunk(tp, dim=0)[r]
    out, grad = _run(lambda x: scatter_to_sequence_region(x, g), full, seq.to(dev))
    _equal(out, seq, "sequence scatter fwd: own slice of dim 0")
    _equal(grad, base, "sequence scatter bwd: all-gather of dim 0")

    out, grad = _run(lambda x: gather_from_sequence_region(x, g), seq.to(dev), mine)
    _equal(out, base, "sequence gather fwd: all-gather of dim 0")
    _equal(grad, total.chunk(tp, dim=0)[r], "sequence gather bwd: reduce-scatter")

    out, grad = _run(
        lambda x: gather_from_sequence_region(x, g, tensor_parallel_output_grad=False),
        seq.to(dev),
        full,
    )
    _equal(out, base, "sequence gather fwd without tp grads: all-gather of dim 0")
    _equal(grad, seq, "sequence gather bwd without tp grads: own slice")

    out, grad = _run(lambda x: reduce_scatter_to_sequence_region(x, g), mine, seq.to(dev))
    _equal(out, total.chunk(tp, dim=0)[r], "reduce-scatter fwd")
    _equal(grad, base, "reduce-scatter bwd: all-gather of dim 0")

    # the public reduce does not write into its input (which autograd may have saved)
    x = mine.clone()
    reduce_from_tp_region(x, g)
    _equal(x, base * (r + 1), "reduce_from_tp_region leaves its input alone")


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_mappings_and_their_duals(dist_pool: DistPool, tp: int) -> None:
    dist_pool.run(_check_mappings, tp, args=(tp,))


def _recording(name: str, fn: Callable[..., object], issued: list[str]) -> Callable[..., object]:
    def call(*args: object, **kwargs: object) -> object:
        issued.append(name)
        return fn(*args, **kwargs)

    return call


def _check_size_one_is_free() -> None:
    g = init_process_groups(ParallelConfig(tp=1)).tp
    x = torch.randn(S, B, H, requires_grad=True)
    issued: list[str] = []
    names = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
    originals = {name: getattr(dist, name) for name in names}
    for name, fn in originals.items():
        setattr(dist, name, _recording(name, fn, issued))
    try:
        for mapping in (
            copy_to_tp_region, reduce_from_tp_region, scatter_to_tp_region,
            gather_from_tp_region, scatter_to_sequence_region, gather_from_sequence_region,
            reduce_scatter_to_sequence_region,
        ):  # fmt: skip
            assert mapping(x, g) is x, mapping.__name__  # no copy, no autograd node
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    assert issued == []


def test_size_one_group_returns_input_itself(dist_pool: DistPool) -> None:
    dist_pool.run(_check_size_one_is_free, 1)


def _indivisible() -> list[str]:
    g = init_process_groups(ParallelConfig(tp=2)).tp
    messages = []
    for fn, x in (
        (scatter_to_sequence_region, torch.zeros(7, 2, 4)),
        (reduce_scatter_to_sequence_region, torch.zeros(5, 2, 4)),
        (scatter_to_tp_region, torch.zeros(4, 2, 5)),
    ):
        try:
            fn(x, g)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_indivisible_sizes_fail_in_one_sentence(dist_pool: DistPool) -> None:
    messages = dist_pool.run(_indivisible, 2)[0]
    assert len(messages) == 3
    assert "sequence length (7) is not divisible by tp (2)" in messages[0]
    assert "sequence length (5) is not divisible by tp (2)" in messages[1]
    assert "last dimension (5) is not divisible by tp (2)" in messages[2]
    assert all("\n" not in m for m in messages)
