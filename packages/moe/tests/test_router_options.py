"""Every routing option, through the whole layer at ep = 2, against the dense reference.

The reference chooses and weights each token's experts with its own plain code (see
_moe_reference.route_token), so these tests check the choice, the combine weights and
the losses' gradients of each option. Tolerance: see _moe_harness.
"""

from __future__ import annotations

from typing import Any

import pytest
from _moe_harness import run_case

from mega_moe import MoEConfig, RouterConfig
from mega_parallel_grid.testing import DistPool

LOSSES: dict[str, Any] = {"aux_loss_coeff": 0.1, "seq_aux_loss_coeff": 0.05, "z_loss_coeff": 0.01}
OPTIONS: dict[str, dict[str, Any]] = {
    "topk-then-softmax": {},
    "softmax-then-topk": {"softmax_before_topk": True},
    "softmax-then-topk-normalized": {"softmax_before_topk": True, "normalize_topk": True},
    "sigmoid": {"score_function": "sigmoid"},
    "sigmoid-normalized-scaled": {
        "score_function": "sigmoid",
        "normalize_topk": True,
        "scaling_factor": 2.5,
    },
    "sigmoid-group-limited": {  # DeepSeek-V3 style: 4 groups of 2, best 2 groups, top-4
        "score_function": "sigmoid",
        "normalize_topk": True,
        "top_k": 4,
        "num_groups": 4,
        "group_topk": 2,
    },
    "softmax-group-limited": {
        "softmax_before_topk": True,
        "top_k": 3,
        "num_groups": 2,
        "group_topk": 1,
    },
}
BIAS = [0.3, -0.2, 0.0, 0.5, -0.4, 0.1, -0.1, 0.2]  # large enough to change choices


def _config(option: dict[str, Any], **kw: Any) -> MoEConfig:
    router_kw = {"num_experts": 8, "top_k": 2, **LOSSES, **option}
    return MoEConfig(router=RouterConfig(**router_kw), ffn_hidden_size=32, **kw)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_routing_option_matches_reference(dist_pool: DistPool, name: str) -> None:
    dispatcher = "allgather" if len(name) % 2 else "alltoall"
    cfg = _config(OPTIONS[name], dispatcher=dispatcher)
    dist_pool.run(run_case, 2, args=(cfg,), kwargs={"ep": 2})


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_expert_bias_steers_choice_not_weights(dist_pool: DistPool, score: str) -> None:
    """With an expert bias the reference adds it to the choice scores only."""
    option = {"score_function": score, "expert_bias": True, "normalize_topk": True}
    dist_pool.run(run_case, 2, args=(_config(option),), kwargs={"ep": 2, "bias": BIAS})


def test_gelu_experts(dist_pool: DistPool) -> None:
    cfg = _config({}, activation="gelu", experts="sequential", shared_ffn_size=16)
    dist_pool.run(run_case, 2, args=(cfg,), kwargs={"ep": 2, "etp": 1})


def test_global_aux_loss_over_dp(dist_pool: DistPool) -> None:
    """Balance over the tokens of all ranks: per-expert counts all-reduced over the group."""
    cfg = _config({"seq_aux_loss_coeff": 0.0, "z_loss_coeff": 0.0})
    dist_pool.run(run_case, 4, args=(cfg,), kwargs={"ep": 2, "aux_global": True})
