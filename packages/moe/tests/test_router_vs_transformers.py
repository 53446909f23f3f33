"""mega's router against ``transformers``' own routers, for the same weights, bias and input.

DeepSeek-V3 (``DeepseekV3TopkRouter``): sigmoid scores, ``e_score_correction_bias`` added
for the choice only, ``n_group`` / ``topk_group`` group-limited routing (a group scores the
sum of its best 2 biased scores), ``norm_topk_prob``, ``routed_scaling_factor``. Qwen3-MoE
(``Qwen3MoeTopKRouter``): softmax over all experts, top-k, ``norm_topk_prob``.

Both sides pick the same experts (compared as sets: neither orders its top-k the same way)
and give the same combine weights, up to the rounding of the router's dot product of
length ``hidden``. Inputs are random normal fp32, so no two scores tie.

``transformers`` (a dev dependency) builds the routers from tiny configs; nothing is
downloaded.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import Tensor

from mega_moe import RouterConfig, TopKRouter
from mega_parallel_grid.testing import assert_close_to_reference

transformers = pytest.importorskip("transformers")

HIDDEN, TOKENS = 32, 64


def _combine(index: Tensor, weights: Tensor, experts: int) -> Tensor:
    """``[N, k]`` indices and weights -> ``[N, E]`` weights, zero where a token does not go."""
    return torch.zeros(index.shape[0], experts).scatter(1, index, weights)


def _mega(config: RouterConfig, weight: Tensor, bias: Tensor | None, x: Tensor) -> Tensor:
    router = TopKRouter(HIDDEN, config)
    with torch.no_grad():
        router.weight.copy_(weight)
        if bias is not None:
            assert router.expert_bias is not None
            router.expert_bias.copy_(bias)
    routing = router.eval()(x)
    assert bool((routing.routing_map.sum(dim=-1) == config.top_k).all())
    return routing.probs.detach()


def _same_routing(mine: Tensor, theirs: Tensor) -> None:
    assert torch.equal(mine != 0, theirs != 0), "a token chose other experts"
    assert_close_to_reference(mine, theirs, reduction_length=HIDDEN, name="combine weights")


def _inputs(experts: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(experts, HIDDEN, generator=gen) * 0.3
    bias = torch.randn(experts, generator=gen) * 0.1  # moves choices, not weights
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    return weight, bias, x


def _deepseek(weight: Tensor, bias: Tensor, x: Tensor, **cfg: Any) -> Tensor:
    config = transformers.DeepseekV3Config(hidden_size=HIDDEN, **cfg)
    gate = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    with torch.no_grad():
        gate.weight.copy_(weight)
        gate.e_score_correction_bias.copy_(bias)
        _, weights, index = gate(x)
    return _combine(index, weights, weight.shape[0])


def _deepseek_router(cfg: dict[str, Any], score_topk: int | None) -> RouterConfig:
    return RouterConfig(
        num_experts=cfg["n_routed_experts"],
        top_k=cfg["num_experts_per_tok"],
        score_function="sigmoid",
        normalize_topk=cfg["norm_topk_prob"],
        scaling_factor=cfg["routed_scaling_factor"],
        num_groups=cfg["n_group"],
        group_topk=cfg["topk_group"],
        group_score_topk=score_topk,
        expert_bias=True,
    )


DEEPSEEK: dict[str, dict[str, Any]] = {
    # DeepSeek-V3's own proportions: top 8 of 256 in 4 of 8 groups (8 // 4 = 2 either rule)
    "v3-shape": {"n_routed_experts": 32, "num_experts_per_tok": 8, "n_group": 8,
                 "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5},
    # top 6 in 2 of 4 groups of 4: Megatron's rule would sum 3 per group, DeepSeek sums 2
    "top6-of-2-groups": {"n_routed_experts": 16, "num_experts_per_tok": 6, "n_group": 4,
                         "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 1.0},
    "one-group-unnormalised": {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 1,
                               "topk_group": 1, "norm_topk_prob": False,
                               "routed_scaling_factor": 1.5},
}  # fmt: skip


@pytest.mark.parametrize("name", list(DEEPSEEK))
def test_deepseek_v3_routing_matches_transformers(name: str) -> None:
    cfg = DEEPSEEK[name]
    weight, bias, x = _inputs(cfg["n_routed_experts"], seed=len(name))
    theirs = _deepseek(weight, bias, x, **cfg)
    _same_routing(_mega(_deepseek_router(cfg, 2), weight, bias, x), theirs)
    # the bias steers the choice only: the weights are the unbiased sigmoid scores
    scores = torch.sigmoid(x @ weight.T)
    kept = scores * (theirs != 0)
    if cfg["norm_topk_prob"]:
        kept = kept / kept.sum(dim=-1, keepdim=True)
    expected = kept * cfg["routed_scaling_factor"]
    assert_close_to_reference(theirs, expected, reduction_length=HIDDEN, name="hand-made")


def test_group_score_rule_matters_when_top_k_is_not_twice_group_topk() -> None:
    """Megatron's default rule (sum of the best top_k // group_topk) picks other groups for
    some tokens of the ``top6-of-2-groups`` case; ``group_score_topk=2`` is what DeepSeek-V3
    computes. (For DeepSeek-V3's own top 8 in 4 groups both rules sum 2.)"""
    cfg = DEEPSEEK["top6-of-2-groups"]
    weight, bias, x = _inputs(cfg["n_routed_experts"], seed=7)
    theirs = _deepseek(weight, bias, x, **cfg)
    megatron = _mega(_deepseek_router(cfg, None), weight, bias, x)
    differs = ((megatron != 0) != (theirs != 0)).any(dim=-1)
    assert 0 < int(differs.sum()) < TOKENS
    shape = DEEPSEEK["v3-shape"]
    rule = _deepseek_router(shape, None)
    assert rule.group_scored_by == replace(rule, group_score_topk=2).group_scored_by == 2


@pytest.mark.parametrize("normalise", [True, False])
def test_qwen3_moe_routing_matches_transformers(normalise: bool) -> None:
    experts, k = 16, 4
    weight, _, x = _inputs(experts, seed=3 + normalise)
    config = transformers.Qwen3MoeConfig(
        hidden_size=HIDDEN, num_experts=experts, num_experts_per_tok=k, norm_topk_prob=normalise
    )
    gate = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        gate.weight.copy_(weight)
        _, weights, index = gate(x)
    theirs = _combine(index, weights, experts)
    mine = RouterConfig(
        num_experts=experts, top_k=k, softmax_before_topk=True, normalize_topk=normalise
    )
    _same_routing(_mega(mine, weight, None, x), theirs)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"group_score_topk": 2}, "group_score_topk (2) needs group-limited routing"),
        (
            {"num_groups": 4, "group_topk": 2, "group_score_topk": 3},
            "group_score_topk (3) exceeds the 2 experts of a group",
        ),
        ({"num_groups": 4, "group_topk": 2, "group_score_topk": 0}, "group_score_topk (0)"),
    ],
)
def test_group_score_topk_bad_input_fails_in_one_sentence(
    kwargs: dict[str, Any], words: str
) -> None:
    with pytest.raises(ValueError) as err:
        RouterConfig(num_experts=8, top_k=4, score_function="sigmoid", **kwargs)
    assert "\n" not in str(err.value)
    assert words in str(err.value)
