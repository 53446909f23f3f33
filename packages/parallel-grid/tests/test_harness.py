"""The pooled harness: real collectives on 1, 2, 4 and 8 ranks, failures and hangs reported."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mega_parallel_grid.testing import DistPool, RankFailedError, RankTimeoutError, rank_device

WORLD_SIZES = [1, 2, 4, 8]


def _collectives() -> dict[str, list[float]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    summed = torch.tensor([float(rank + 1)], device=dev)
    dist.all_reduce(summed)
    gathered = [torch.zeros(2, device=dev) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(rank), float(rank * 10)], device=dev))
    shared = torch.tensor([float(rank) + 0.5], device=dev)
    dist.broadcast(shared, src=world - 1)
    # a ring of send/recv: each rank sends its rank to the next, receives from the previous
    received = torch.tensor([-1.0], device=dev)
    if world > 1:
        ops = [
            dist.P2POp(dist.isend, torch.tensor([float(rank)], device=dev), (rank + 1) % world),
            dist.P2POp(dist.irecv, received, (rank - 1) % world),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return {
        "sum": summed.tolist(),
        "gathered": torch.cat(gathered).tolist(),
        "broadcast": shared.tolist(),
        "received": received.tolist(),
    }


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_real_collectives(dist_pool: DistPool, world: int) -> None:
    results = dist_pool.run(_collectives, world)
    assert len(results) == world
    for rank, out in enumerate(results):
        assert out["sum"] == [world * (world + 1) / 2]
        assert out["gathered"] == [v for r in range(world) for v in (float(r), float(r * 10))]
        assert out["broadcast"] == [world - 1 + 0.5]
        assert out["received"] == ([float((rank - 1) % world)] if world > 1 else [-1.0])


def _rank_and_args(a: int, *, b: int) -> tuple[int, int, int, float]:
    return dist.get_rank(), a, b, float(torch.rand(1))


def test_arguments_results_and_seed(dist_pool: DistPool) -> None:
    out = dist_pool.run(_rank_and_args, 4, args=(3,), kwargs={"b": 5}, seed=7)
    assert [o[:3] for o in out] == [(r, 3, 5) for r in range(4)]
    torch.manual_seed(7)
    expected = float(torch.rand(1))
    assert all(o[3] == expected for o in out)  # every rank seeded alike


def _make_group() -> int:
    from torch.distributed import distributed_c10d as c10d

    before = len(c10d._world.pg_map)
    dist.new_group([0, 1])
    return before


def test_groups_do_not_leak_between_calls(dist_pool: DistPool) -> None:
    first = dist_pool.run(_make_group, 2)
    second = dist_pool.run(_make_group, 2)
    assert first == second == [1, 1]  # only the default group at the start of each call


def _fail_on_rank(bad: int) -> None:
    if dist.get_rank() == bad:
        raise ValueError(f"planted failure on rank {bad}")
    dist.barrier()


def test_failing_rank_reported_with_traceback(dist_pool: DistPool) -> None:
    with pytest.raises(RankFailedError, match=r"rank 2 of 4 failed in _fail_on_rank") as info:
        dist_pool.run(_fail_on_rank, 4, args=(2,))
    assert "planted failure on rank 2" in str(info.value)
    assert "Traceback" in str(info.value)
    assert dist_pool.run(_rank_and_args, 4, args=(1,), kwargs={"b": 2})[3][0] == 3  # recovered


def _hang_on_rank(bad: int) -> None:
    if dist.get_rank() != bad:
        dist.barrier()  # ``bad`` never joins: the others block


def test_hung_rank_times_out_in_bounded_time(dist_pool: DistPool) -> None:
    start = time.monotonic()
    with pytest.raises(RankTimeoutError, match=r"ranks \[0, 2\] never returned"):
        dist_pool.run(_hang_on_rank, 3, args=(1,), timeout=3.0)
    assert time.monotonic() - start < 20
    assert len(dist_pool.run(_rank_and_args, 3, args=(0,), kwargs={"b": 0})) == 3


def _die_on_rank(bad: int) -> None:
    if dist.get_rank() == bad:
        os._exit(3)
    dist.barrier()


def test_dead_rank_reported(dist_pool: DistPool) -> None:
    with pytest.raises(RankFailedError, match=r"rank 1 .*(exit code 3|died|closed its pipe)"):
        dist_pool.run(_die_on_rank, 2, args=(1,), timeout=30.0)
    assert len(dist_pool.run(_rank_and_args, 2, args=(0,), kwargs={"b": 0})) == 2


def test_local_function_rejected(dist_pool: DistPool) -> None:
    def local() -> None:
        pass

    with pytest.raises(ValueError, match=r"define the function at module level"):
        dist_pool.run(local, 2)
    with pytest.raises(ValueError, match=r"world_size \(0\) must be a positive integer"):
        dist_pool.run(_rank_and_args, 0)


def test_pool_as_context_manager() -> None:
    with DistPool(backend="gloo") as pool:
        assert pool.run(_collectives, 2)[1]["sum"] == [3.0]


def _device_type() -> str:
    return rank_device().type


def test_rank_device_follows_backend(dist_pool: DistPool) -> None:
    expected = "cuda" if dist_pool.workers(2).backend == "nccl" else "cpu"
    assert dist_pool.run(_device_type, 2) == [expected, expected]


def _connect_fails_once(marker: str) -> int:
    path = Path(marker)
    if dist.get_rank() == 1 and not path.exists():
        path.write_text("failed once")
        raise RuntimeError("Gloo connectFullMesh failed with [pair.cc]: Connection closed by peer")
    return dist.get_rank()


def _connect_always_fails() -> None:
    raise RuntimeError("Gloo connectFullMesh failed with [pair.cc]: Connection closed by peer")


def test_transient_gloo_connect_failure_is_retried_once(
    dist_pool: DistPool, tmp_path: Path
) -> None:
    with pytest.warns(UserWarning, match="retrying once"):
        assert dist_pool.run(_connect_fails_once, 2, args=(str(tmp_path / "marker"),)) == [0, 1]
    with pytest.warns(UserWarning), pytest.raises(RankFailedError, match="connectFullMesh"):
        dist_pool.run(_connect_always_fails, 2)
    assert dist_pool.run(_rank_and_args, 2, args=(1,), kwargs={"b": 2})[1][0] == 1  # recovered
