"""Run parallel code on N local processes, fast enough for unit tests.

Pooled workers (gloo on CPU, NCCL when one GPU per rank is visible) start once per test
session; each call gets a fresh process group. With pytest, request the ``dist_pool``
fixture (registered automatically by this package's pytest plugin)::

    def _check(n):
        t = torch.ones(1)
        torch.distributed.all_reduce(t)
        assert t.item() == n

    def test_all_reduce(dist_pool):
        dist_pool.run(_check, world_size=4, args=(4,))
"""

from mega_parallel_grid.testing.device import rank_device
from mega_parallel_grid.testing.pool import DistPool, RankFailedError, RankTimeoutError
from mega_parallel_grid.testing.solo import solo_groups

__all__ = ["DistPool", "RankFailedError", "RankTimeoutError", "rank_device", "solo_groups"]
