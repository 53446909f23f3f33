"""HSDP for experts: edp split into edp_shard (fastest) x edp_replicate, no processes."""

from __future__ import annotations

import pytest

from mega_parallel_grid import ParallelConfig, RankLayout

# (world, config): replicas holding every expert (ep*etp divides tp*cp*dp_shard), replicas
# too small for that (tp*cp*dp_shard divides ep*etp), neither, no HSDP, tp/etp/cp/pp mixed
LAYOUTS = [
    (4, ParallelConfig(ep=2, dp_shard=2)),
    (4, ParallelConfig(dp_shard=2)),
    (8, ParallelConfig(ep=2, dp_shard=4)),
    (8, ParallelConfig(ep=4, dp_shard=2)),
    (8, ParallelConfig(ep=8, dp_shard=4)),
    (6, ParallelConfig(ep=2, dp_shard=3)),
    (8, ParallelConfig(ep=2)),
    (16, ParallelConfig(tp=2, ep=2, etp=1, dp_shard=2, pp=2)),
    (16, ParallelConfig(tp=2, cp=2, ep=2, dp_shard=2)),
    (16, ParallelConfig(ep=2, dp_shard=2, order="tp-cp-dp-ep-pp")),
]


def _experts(layout: RankLayout, rank: int) -> tuple[int, int, int]:
    """What decides the experts a rank holds: its ep, etp and pp coordinates."""
    co = layout.coords(rank)
    return co["ep"], co["etp"], co["pp"]


@pytest.mark.parametrize(("world", "config"), LAYOUTS, ids=lambda v: repr(v)[:60])
def test_expert_shard_and_replicate_groups_factor_edp(world: int, config: ParallelConfig) -> None:
    layout = RankLayout(world, config)
    assert layout.edp_shard * layout.edp_replicate == layout.edp
    shards, replicas = layout.groups("edp_shard"), layout.groups("edp_replicate")
    for groups, size in ((shards, layout.edp_shard), (replicas, layout.edp_replicate)):
        assert sorted(r for g in groups for r in g) == list(range(world))  # a partition
        assert {len(g) for g in groups} == {size}
    for rank in range(world):
        co = layout.coords(rank)
        shard = layout.group_of("edp_shard", rank)
        rep = layout.group_of("edp_replicate", rank)
        edp = layout.group_of("edp", rank)
        # every rank of both groups holds this rank's experts, inside its edp group
        assert {_experts(layout, r) for r in shard + rep} == {_experts(layout, rank)}
        assert set(shard) | set(rep) <= set(edp)
        assert set(shard) & set(rep) == {rank}  # orthogonal
        assert len(shard) * len(rep) == len(edp)
        assert co["edp"] == co["edp_shard"] + co["edp_replicate"] * layout.edp_shard
        assert shard[co["edp_shard"]] == rank and rep[co["edp_replicate"]] == rank
        assert sorted(layout.group_of("edp_shard-edp_replicate", rank)) == sorted(edp)


@pytest.mark.parametrize(
    ("world", "config"), LAYOUTS[:5] + LAYOUTS[7:9], ids=lambda v: repr(v)[:60]
)
def test_expert_shard_group_lies_inside_one_replica(world: int, config: ParallelConfig) -> None:
    """In the default order, with one of ep*etp and tp*cp*dp_shard dividing the other."""
    layout = RankLayout(world, config)
    assert layout.edp_replicate == min(layout.edp, layout.dp_replicate)
    for rank in range(world):
        shard = layout.group_of("edp_shard", rank)
        assert {layout.coords(r)["dp_replicate"] for r in shard} == {
            layout.coords(rank)["dp_replicate"]
        }
    if layout.edp % layout.dp_replicate == 0:  # one expert replica per dense replica
        assert sorted(layout.groups("edp_replicate")) == sorted(layout.groups("dp_replicate"))


def test_worked_examples() -> None:
    # ep 2 over dp 4 = 2 x 2: a replica (ranks 0, 1) holds each expert once, on one rank
    layout = RankLayout(4, ParallelConfig(ep=2, dp_shard=2))
    assert layout.groups("edp") == [[0, 2], [1, 3]]
    assert layout.groups("edp_shard") == [[0], [1], [2], [3]]
    assert layout.groups("edp_replicate") == [[0, 2], [1, 3]]
    # ep 2 over dp 8 = 4 x 2: each replica of 4 ranks shards its experts over 2
    layout = RankLayout(8, ParallelConfig(ep=2, dp_shard=4))
    assert layout.groups("edp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("edp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # ep 2 over dp 6 = 3 x 2: neither divides the other, no expert replicas (gcd(3, 2) = 1)
    layout = RankLayout(6, ParallelConfig(ep=2, dp_shard=3))
    assert (layout.edp_shard, layout.edp_replicate) == (3, 1)


def test_without_hsdp_the_expert_shard_group_is_edp() -> None:
    layout = RankLayout(8, ParallelConfig(tp=2, ep=2))
    assert layout.groups("edp_shard") == layout.groups("edp")
    assert layout.groups("edp_replicate") == [[r] for r in range(8)]


def test_edp_and_its_factors_are_not_combined() -> None:
    layout = RankLayout(4, ParallelConfig(ep=2, dp_shard=2))
    with pytest.raises(ValueError, match="names a dimension twice"):
        layout.groups("edp-edp_shard")
    with pytest.raises(ValueError, match="mixes dense"):
        layout.groups("dp_shard-edp_shard")
    with pytest.raises(ValueError, match="edp_shard, edp_replicate joined by"):
        layout.groups("edp_sharded")
