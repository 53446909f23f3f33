"""The dry-run estimate's parameter counts against the parameters the trainer really builds."""

from __future__ import annotations

import pytest
import torch

from mega_moe import expert_shard
from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_pretrain.build import build, gpt_config, parallel_config
from mega_pretrain.config import load_config
from mega_pretrain.estimate import estimate
from mega_pretrain.validate import check_config


def _counts(size: str, layout: tuple[tuple[str, str], ...]) -> tuple[int, int, int, int, int]:
    """(built params on this rank, built expert params on this rank, estimated total,
    estimated per rank, estimated expert params per rank)."""
    config = load_config(None, [("model.size", size), *layout])
    model = gpt_config(config)
    plan = check_config(config, model, torch.distributed.get_world_size())
    groups = init_process_groups(parallel_config(config))
    built = build(config, groups, rank_device())
    params = [p for c in built.chunks for p in c.parameters()]
    experts = sum(p.numel() for p in params if expert_shard(p))
    est = estimate(plan)
    etp = config.parallel.etp or config.parallel.tp
    moe_layers = len(model.moe_layers) if model.is_moe else 0
    per_expert = 3 * model.hidden_size * model.moe_ffn_size if model.is_moe else 0
    expected_experts = moe_layers * model.num_experts * per_expert
    expected_experts //= config.parallel.pp * config.parallel.ep * etp
    return (
        sum(p.numel() for p in params),
        experts,
        est.total_params,
        est.params_per_rank,
        expected_experts,
    )


@pytest.mark.parametrize(
    "size", ["tiny", "mixtral-tiny", "moe-tiny", "hybrid-tiny", "hybrid-moe-tiny"]
)
def test_total_parameters_are_exact(dist_pool: DistPool, size: str) -> None:
    [(built, _, total, per_rank, _)] = dist_pool.run(_counts, 1, args=(size, ()))
    assert total == built and per_rank == built


LAYOUTS = {
    "tiny-tp2": ("tiny", (("tp", "2"),)),
    "tiny-pp2": ("tiny", (("pp", "2"),)),
    "tiny-pp2-uneven": ("tiny", (("pp", "2"), ("parallel.pp_layers", "5,3"))),
    "mixtral-ep2": ("mixtral-tiny", (("ep", "2"),)),
    "moe-tp2-ep2-etp1": ("moe-tiny", (("tp", "2"), ("ep", "2"), ("etp", "1"))),
    "hybrid-moe-ep2": ("hybrid-moe-tiny", (("ep", "2"),)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_per_rank_parameters(dist_pool: DistPool, name: str) -> None:
    size, layout = LAYOUTS[name]
    ranks = dist_pool.run(_counts, 2, args=(size, layout))
    busiest = max(built for built, *_ in ranks)
    for _, experts, _, per_rank, expected_experts in ranks:
        assert experts == expected_experts  # routed experts: split over ep x etp exactly
        # the estimate divides norms and the padded vocabulary rows by tp like the matmul
        # weights; on these tiny models that is under 1 % of a rank's parameters
        assert abs(per_rank - busiest) <= 0.01 * busiest, (per_rank, busiest)


def _fp8_cache_bytes() -> tuple[int, int, int, int]:
    """(estimated cache bytes, the caches' real bytes, 2 x the built layer parameters, the
    hidden size)."""
    from mega_tp_layers import Fp8WeightCache

    overrides = [("model.size", "tiny"), ("train.precision", "bf16"), ("train.fp8", "true"),
                 ("train.fp8_weight_cache", "true")]  # fmt: skip
    config = load_config(None, overrides)
    plan = check_config(config, gpt_config(config), 1)
    built = build(config, init_process_groups(parallel_config(config)), rank_device())
    caches = [m for c in built.chunks for m in c.modules() if isinstance(m, Fp8WeightCache)]
    real = sum(c.data.numel() + c.data_t.numel() for c in caches)  # one byte an element
    layers = sum(
        p.numel() for c in built.chunks for n, p in c.named_parameters() if n.startswith("layers.")
    )
    return estimate(plan).fp8_cache, real, 2 * layers, plan.model.hidden_size


def test_fp8_cache_memory_is_two_bytes_a_layer_parameter(dist_pool: DistPool) -> None:
    """The estimate counts two bytes for every parameter of the rank's layers; the built
    caches hold two bytes for every fp8 linear weight: the same up to the layers' norms."""
    [(est, real, layers, hidden)] = dist_pool.run(_fp8_cache_bytes, 1)
    # the per-layer share of the parameters also spreads the final norm over the layers
    assert est - layers == 2 * hidden, (est, layers)
    assert 0 < real <= est and (est - real) <= 0.01 * est, (est, real)
