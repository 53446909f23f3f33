"""Per-call cost of the pooled test harness against spawning fresh processes.

uv run python bench/harness_overhead.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from mega_parallel_grid.testing import DistPool, rank_device


def _all_reduce() -> float:
    t = torch.ones(4, device=rank_device())
    dist.all_reduce(t)
    return float(t[0])


def _fresh_entry(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    _all_reduce()
    dist.destroy_process_group()


def _fresh_spawn(world_size: int, port: int) -> float:
    start = time.perf_counter()
    tmp.spawn(_fresh_entry, args=(world_size, port), nprocs=world_size, join=True)
    return time.perf_counter() - start


def main() -> None:
    rows = []
    with DistPool() as pool:
        for n in (1, 2, 4, 8):
            t0 = time.perf_counter()
            pool.run(_all_reduce, n)
            first = time.perf_counter() - t0
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                assert pool.run(_all_reduce, n) == [float(n)] * n
                times.append(time.perf_counter() - t0)
            fresh = _fresh_spawn(n, 29600 + n)
            rows.append((n, first, statistics.median(times), fresh))
    print(f"{'ranks':>5} {'pool start s':>12} {'pooled call ms':>15} {'fresh spawn s':>14}")
    for n, first, med, fresh in rows:
        print(f"{n:>5} {first:>12.2f} {med * 1e3:>15.1f} {fresh:>14.2f}")


if __name__ == "__main__":
    main()
