"""Initialisation does not depend on the layout, survives the meta device, keeps metadata."""

from __future__ import annotations

import pytest
import torch

from mega_moe import EXPERT_ATTR, MoEConfig, MoELayer, RouterConfig, expert_shard
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_tp_layers import INIT_ATTR, SHARD_ATTR, init_parameters, shard_spec, shard_tensor

H = 16


def _cfg(experts: str) -> MoEConfig:
    rc = RouterConfig(num_experts=8, top_k=2, expert_bias=True)
    return MoEConfig(router=rc, ffn_hidden_size=32, experts=experts, shared_ffn_size=16)  # type: ignore[arg-type]


def _expected(name: str, param: torch.Tensor, solo: MoELayer) -> torch.Tensor:
    """This rank's slice of the one-process layer's weight ``name``."""
    shard = expert_shard(param)
    if shard is None:
        spec = shard_spec(param)
        assert spec is not None
        return shard_tensor(solo.get_parameter(name).detach(), spec)
    if shard.stacked:
        full = solo.get_parameter(name).detach()[
            shard.first_expert : shard.first_expert + shard.num_local
        ]
    else:
        full = solo.get_parameter(name).detach()
    return full.chunk(shard.etp, dim=shard.etp_dim + int(shard.stacked))[shard.etp_rank]


def _meta_then_init(experts: str, seed: int | None) -> None:
    groups = init_process_groups(ParallelConfig(tp=2, ep=2, etp=2))
    dev, cfg = rank_device(), _cfg(experts)
    kw = {"ep_group": groups.ep, "etp_group": groups.etp, "tp_group": groups.tp}
    if seed is None:  # the default generator: every rank draws every expert in order
        torch.manual_seed(7)
        built = MoELayer(H, cfg, name="moe", device=dev, **kw)
        torch.manual_seed(7)
        solo = MoELayer(H, cfg, name="moe")
    else:
        built = MoELayer(H, cfg, seed=seed, name="moe", device=dev, **kw)
        solo = MoELayer(H, cfg, seed=seed, name="moe")
    for name, p in built.named_parameters():
        assert torch.equal(p.detach().cpu(), _expected(name, p, solo)), name
    if seed is None:
        return
    meta = MoELayer(H, cfg, device="meta", **kw)
    meta.to_empty(device=dev)
    init_parameters(meta, seed, prefix="moe.")
    assert meta.router.expert_bias is not None
    assert torch.count_nonzero(meta.router.expert_bias) == 0  # zeroed on materialisation
    for (name, p), (_, q) in zip(meta.named_parameters(), built.named_parameters(), strict=True):
        assert torch.equal(p, q), name
        for attr in (SHARD_ATTR, INIT_ATTR, EXPERT_ATTR):
            assert getattr(p, attr, None) == getattr(q, attr, None), (name, attr)


@pytest.mark.parametrize("seed", [3, None], ids=["seeded", "default-generator"])
@pytest.mark.parametrize("experts", ["grouped", "sequential"])
def test_same_full_weights_at_any_layout(
    dist_pool: DistPool, experts: str, seed: int | None
) -> None:
    dist_pool.run(_meta_then_init, 4, args=(experts, seed))


def test_expert_metadata() -> None:
    layer = MoELayer(H, _cfg("grouped"), seed=0)
    w1 = layer.experts.get_parameter("weight1")
    shard = expert_shard(w1)
    assert shard is not None and shard.stacked and list(shard.experts) == list(range(8))
    assert shard.expert_shape == (2, 32, H)
    spec = shard_spec(w1)
    assert spec is not None and spec.group == "ep" and spec.full_shape == (8, 2, 32, H)
    assert expert_shard(layer.router.weight) is None
    seq = MoELayer(H, _cfg("sequential"), seed=0)
    p = seq.experts.get_parameter("local_experts.5.weight2")
    shard = expert_shard(p)
    assert shard is not None and not shard.stacked and list(shard.experts) == [5]
