"""init_process_groups builds the layout's groups on real processes."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from mega_parallel_grid import GROUP_DIMS, ParallelConfig, RankLayout, init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device


def _check_groups(config: ParallelConfig) -> dict[str, list[int]]:
    groups = init_process_groups(config, timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = RankLayout(world, config)
    for name, dims in GROUP_DIMS.items():
        expected = layout.group_of(dims, rank)
        assert dist.get_process_group_ranks(groups.group(name)) == expected, name
        assert groups.size(name) == len(expected)
        assert groups.rank(name) == expected.index(rank)
    assert dist.get_process_group_ranks(groups.embedding) == layout.embedding_ranks(rank)
    assert groups.group("dp-cp") is groups.dp_cp and groups.group("tp-pp") is groups.mp
    # a collective on the tp group sums exactly over its members
    t = torch.tensor([float(rank)], device=rank_device())
    dist.all_reduce(t, group=groups.tp)
    assert t.item() == sum(layout.group_of("tp", rank))
    return {name: dist.get_process_group_ranks(groups.group(name)) for name in GROUP_DIMS}


@pytest.mark.parametrize(
    ("world", "config"),
    [
        (1, ParallelConfig()),
        (2, ParallelConfig(tp=2)),
        (4, ParallelConfig(tp=2, pp=2)),
        (4, ParallelConfig(dp_shard=2)),
        (8, ParallelConfig(tp=2, cp=2, dp_shard=1)),
        (8, ParallelConfig(tp=2, pp=2, cp=2)),
        (8, ParallelConfig(tp=2, pp=4)),
        (4, ParallelConfig(pp=4, vpp=2)),
        (8, ParallelConfig(tp=2, cp=2, ep=2, etp=1)),
        (8, ParallelConfig(tp=2, pp=2, ep=2, order="tp-cp-ep-dp-pp", vpp=2)),
    ],
    ids=lambda v: str(v) if isinstance(v, int) else "",
)
def test_groups_match_layout(dist_pool: DistPool, world: int, config: ParallelConfig) -> None:
    results = dist_pool.run(_check_groups, world, args=(config,))
    assert len(results) == world


def _device_mesh() -> tuple[tuple[str, ...], list[int]]:
    groups = init_process_groups(ParallelConfig(tp=2, pp=2))
    mesh = groups.device_mesh()
    names = mesh.mesh_dim_names
    assert names is not None
    return names, list(mesh.mesh.shape)


def test_device_mesh_view(dist_pool: DistPool) -> None:
    names, shape = dist_pool.run(_device_mesh, 8)[0]
    assert names == ("pp", "dp", "cp", "tp")
    assert shape == [2, 2, 1, 2]


def _bad_config() -> str:
    try:
        init_process_groups(ParallelConfig(tp=4))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_bad_world_fails_before_any_group(dist_pool: DistPool) -> None:
    messages = dist_pool.run(_bad_config, 2)
    assert all("world size (2) is not divisible by tp*cp*pp (4*1*1 = 4)" in m for m in messages)


def _unknown_group() -> str:
    groups = init_process_groups(ParallelConfig())
    try:
        groups.group("xp")
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_unknown_group_name(dist_pool: DistPool) -> None:
    assert "no process group named 'xp'" in dist_pool.run(_unknown_group, 1)[0]


def test_uninitialised_without_launcher_says_how(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"launch with torchrun"):
        init_process_groups(ParallelConfig())
