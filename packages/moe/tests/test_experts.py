"""GroupedMLP: torch._grouped_mm and its loop fallback agree, and agree with SequentialMLP.

Tolerance: fp32; the two paths run the same products through different kernels, so each
tensor is within the rounding bound of ``assert_close_to_reference`` for the experts'
chain of sums (H, FFN forward and back, then the tokens of a weight gradient).
"""

from __future__ import annotations

import pytest
import torch

from mega_moe import GroupedMLP, SequentialMLP
from mega_parallel_grid.testing import assert_close_to_reference

H, FFN, E = 16, 32, 4
COUNTS = [3, 0, 5, 2]  # an expert with no tokens still gets a (zero) gradient
N = 2 * (H + FFN) + sum(COUNTS)


def _close(a: torch.Tensor, b: torch.Tensor, what: str = "tensor") -> None:
    assert_close_to_reference(a, b, reduction_length=N, name=what)


def _run(mlp: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    y = mlp(x, COUNTS)
    y.backward(dy)
    assert x.grad is not None
    return (y.detach(), x.grad, *(p.grad for p in mlp.parameters() if p.grad is not None))


def _grouped_mm_runs_here() -> bool:
    return hasattr(torch, "_grouped_mm") and torch.__version__ >= "2.9"


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_mm_and_loop_agree(activation: str) -> None:
    fast = GroupedMLP(H, FFN, E, activation=activation, seed=0, gemm="auto")  # type: ignore[arg-type]
    slow = GroupedMLP(H, FFN, E, activation=activation, seed=0, gemm="loop")  # type: ignore[arg-type]
    x, dy = torch.randn(sum(COUNTS), H), torch.randn(sum(COUNTS), H)
    assert fast.uses_grouped_mm(x) == _grouped_mm_runs_here()
    assert not slow.uses_grouped_mm(x)
    for i, (a, b) in enumerate(zip(_run(fast, x, dy), _run(slow, x, dy), strict=True)):
        _close(a, b, f"result {i}")
    grad = fast.weight1.grad
    assert grad is not None and torch.count_nonzero(grad[1]) == 0  # expert 1 had no tokens


def test_grouped_equals_sequential_on_the_same_weights() -> None:
    grouped = GroupedMLP(H, FFN, E, seed=0)
    seq = SequentialMLP(H, FFN, E, seed=1)
    with torch.no_grad():
        for e, expert in enumerate(seq.local_experts.values()):
            expert.weight1.copy_(grouped.weight1[e])
            expert.weight2.copy_(grouped.weight2[e])
    x, dy = torch.randn(sum(COUNTS), H), torch.randn(sum(COUNTS), H)
    ga, sa = _run(grouped, x, dy), _run(seq, x, dy)
    _close(ga[0], sa[0])
    _close(ga[1], sa[1])
    w1, w2 = ga[2], ga[3]
    per_expert = list(sa[2:])
    for e in range(E):
        _close(w1[e], per_expert[2 * e])
        _close(w2[e], per_expert[2 * e + 1])


def test_forced_grouped_mm_fails_clearly_where_it_cannot_run() -> None:
    mlp = GroupedMLP(H, FFN, E, seed=0, gemm="grouped_mm", dtype=torch.float64)
    with pytest.raises(RuntimeError, match="gemm='auto'") as info:
        mlp(torch.randn(sum(COUNTS), H, dtype=torch.float64), COUNTS)
    assert "\n" not in str(info.value)
