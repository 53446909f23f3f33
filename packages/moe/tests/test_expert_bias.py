"""Aux-loss-free balancing: the expert bias moves a skewed router's load toward balance.

Measured on a synthetic router whose two first experts win almost every token (load
imbalance max/mean ~ 3.98 of at most E/k = 4): after 300 bias updates of rate 0.003 the
imbalance on held-out tokens is ~1.15 (sigmoid scores) and ~1.3 (softmax).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mega_moe import MoEConfig, MoELayer, RouterConfig, TopKRouter, update_expert_biases
from mega_parallel_grid.testing import DistPool, rank_device

H = 16


def _skewed_router(score: str) -> tuple[TopKRouter, torch.Generator, torch.Tensor]:
    rc = RouterConfig(
        num_experts=8,
        top_k=2,
        score_function=score,
        softmax_before_topk=True,  # type: ignore[arg-type]
        expert_bias=True,
        bias_update_rate=0.003,
    )
    router = TopKRouter(H, rc, seed=1)
    gen = torch.Generator().manual_seed(3)
    mean = torch.randn(H, generator=gen)  # tokens lean along `mean`, and so do experts 0, 1
    with torch.no_grad():
        router.weight[:2] += 0.3 * mean / mean.norm()
    return router, gen, mean


def _imbalance(router: TopKRouter, x: torch.Tensor) -> float:
    router.eval()
    counts = router(x).stats.tokens_per_expert.float()
    router.train()
    return float(counts.max() / counts.mean())


@pytest.mark.parametrize(("score", "bound"), [("sigmoid", 1.35), ("softmax", 1.5)])
def test_bias_balances_a_skewed_router(score: str, bound: float) -> None:
    router, gen, mean = _skewed_router(score)
    held_out = torch.randn(1024, H, generator=gen) + mean
    before = _imbalance(router, held_out)
    late = []
    for step in range(300):
        router(torch.randn(256, H, generator=gen) + mean)
        router.update_expert_bias()
        if step >= 200 and step % 20 == 0:
            late.append(_imbalance(router, held_out))
    assert before > 3.5, f"the synthetic router is not skewed (imbalance {before:.2f})"
    assert max(late) < bound, f"imbalance {before:.2f} -> {late} (bound {bound})"
    assert router.weight.grad is None  # balancing touched no weight


def _biases_agree() -> list[float]:
    """Two ranks route different tokens; one batched update keeps their biases equal."""
    rank, dev = dist.get_rank(), rank_device()
    rc = RouterConfig(num_experts=8, top_k=2, expert_bias=True, bias_update_rate=0.01)
    cfg = MoEConfig(router=rc, ffn_hidden_size=16)
    layers = torch.nn.ModuleList([MoELayer(H, cfg, seed=s, device=dev) for s in (1, 2)])
    solo = [MoELayer(H, cfg, seed=s) for s in (1, 2)]
    xs = torch.randn(2, 4, 3, H)  # one batch per rank
    for layer, ref in zip(layers, solo, strict=True):
        layer(xs[rank].to(dev))
        for r in range(2):
            ref(xs[r])
        ref.update_expert_bias()
    update_expert_biases(layers, dist.group.WORLD)
    for layer, ref in zip(layers, solo, strict=True):
        assert layer.router.expert_bias is not None and ref.router.expert_bias is not None
        assert torch.equal(layer.router.expert_bias.cpu(), ref.router.expert_bias)
        assert int(layer.router.load.sum()) == 0
    bias = layers[0].router.expert_bias
    assert bias is not None
    return bias.tolist()


def test_batched_update_over_ranks_equals_one_process(dist_pool: DistPool) -> None:
    first, second = dist_pool.run(_biases_agree, 2)
    assert first == second and any(v != 0 for v in first)


def test_update_needs_expert_bias() -> None:
    router = TopKRouter(H, RouterConfig(num_experts=4, top_k=1))
    with pytest.raises(ValueError, match="expert_bias=True") as info:
        router.update_expert_bias()
    assert "\n" not in str(info.value)


def test_bias_stays_fp32_when_the_router_is_cast_to_bf16() -> None:
    """``router.to(torch.bfloat16)`` casts the weight, not the bias: in bf16 a step of
    1e-3 from 0.5 rounds away (bf16's spacing there is 2**-8). Both sides below do the
    same fp32 operations, so they agree exactly."""
    rc = RouterConfig(num_experts=4, top_k=1, expert_bias=True, bias_update_rate=1e-3)
    router = TopKRouter(H, rc, seed=0)
    assert router.expert_bias is not None
    with torch.no_grad():
        router.expert_bias.fill_(0.5)
    router.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16
    assert router.expert_bias.dtype == torch.float32
    router.apply_load(torch.tensor([0.0, 2.0, 2.0, 4.0]))  # mean 2: 0 under, 3 over
    expected = torch.full((4,), 0.5) + 1e-3 * torch.tensor([1.0, 0.0, 0.0, -1.0])
    assert torch.equal(router.expert_bias, expected)
    routing = router(torch.randn(6, H, dtype=torch.bfloat16))  # still routes (fp32 math)
    assert routing.probs.dtype == torch.float32
