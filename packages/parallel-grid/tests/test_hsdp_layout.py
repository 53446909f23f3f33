"""HSDP: dp split into dp_shard (consecutive dp ranks) x dp_replicate (strided), no processes."""

from __future__ import annotations

import pytest

from mega_parallel_grid import ParallelConfig, RankLayout


def test_shard_groups_are_consecutive_dp_ranks() -> None:
    layout = RankLayout(8, ParallelConfig(dp_shard=2))
    assert (layout.dp, layout.dp_shard, layout.dp_replicate) == (8, 2, 4)
    assert layout.groups("dp_shard") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp_replicate") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.groups("dp") == [list(range(8))]


def test_hsdp_with_tp_cp_pp_factors_dp() -> None:
    config = ParallelConfig(tp=2, cp=2, pp=2, dp_shard=2)
    layout = RankLayout(32, config)  # dp 4 = 2 x 2
    assert layout.groups("tp") == RankLayout(32, ParallelConfig(tp=2, cp=2, pp=2)).groups("tp")
    assert layout.groups("dp_shard")[0] == [0, 4]  # tp*cp = 4 ranks apart
    assert layout.groups("dp_replicate")[0] == [0, 8]
    assert layout.groups("dp_shard-cp")[0] == [0, 2, 4, 6]
    assert layout.groups("dp") == RankLayout(32, ParallelConfig(tp=2, cp=2, pp=2)).groups("dp")
    for rank in range(32):
        co = layout.coords(rank)
        assert co["dp"] == co["dp_shard"] + 2 * co["dp_replicate"]
        assert layout.group_of("dp_shard", rank)[co["dp_shard"]] == rank
        assert layout.group_of("dp_replicate", rank)[co["dp_replicate"]] == rank
        # one shard group and one replicate group meet in this rank alone
        shard, rep = layout.group_of("dp_shard", rank), layout.group_of("dp_replicate", rank)
        assert set(shard) & set(rep) == {rank}


def test_default_shards_over_all_of_dp() -> None:
    layout = RankLayout(8, ParallelConfig(tp=2))
    assert layout.groups("dp_shard") == layout.groups("dp")
    assert layout.groups("dp_replicate") == [[r] for r in range(8)]
    assert layout.dp_replicate == 1


@pytest.mark.parametrize(
    ("world", "kwargs", "message"),
    [
        (8, {"dp_shard": 3}, r"dp \(8\) is not divisible by dp_shard \(3\); choose"),
        (8, {"tp": 2, "dp_shard": 8}, r"dp \(4\) is not divisible by dp_shard \(8\)"),
    ],
)
def test_bad_dp_shard_for_the_world(world: int, kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        RankLayout(world, ParallelConfig(**kwargs))  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_bad_dp_shard_value(value: object) -> None:
    with pytest.raises(ValueError, match=r"dp_shard \(.*\) must be a positive integer") as info:
        ParallelConfig(dp_shard=value)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_dp_and_its_factors_are_not_combined() -> None:
    layout = RankLayout(4, ParallelConfig(dp_shard=2))
    with pytest.raises(ValueError, match="names a dimension twice"):
        layout.groups("dp-dp_shard")
    with pytest.raises(ValueError, match="mixes dense"):
        layout.groups("dp_shard-edp")
