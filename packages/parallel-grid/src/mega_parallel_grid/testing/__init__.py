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

Compare a parallel result with its single-process reference through
:func:`assert_close_to_reference`: a bound scaled by the tensor's magnitude and the length
of the reductions that produced it, so it holds on any CPU's kernels (see ``tolerance``).
"""

from mega_parallel_grid.testing.device import rank_device
from mega_parallel_grid.testing.kernel_child import run_kernel_child
from mega_parallel_grid.testing.pool import DistPool, RankFailedError, RankTimeoutError
from mega_parallel_grid.testing.sibling import sibling_module
from mega_parallel_grid.testing.solo import solo_groups
from mega_parallel_grid.testing.tolerance import (
    MARGIN,
    assert_close_to_reference,
    rounding_bound,
)

__all__ = [
    "MARGIN",
    "DistPool",
    "RankFailedError",
    "RankTimeoutError",
    "assert_close_to_reference",
    "rank_device",
    "rounding_bound",
    "run_kernel_child",
    "sibling_module",
    "solo_groups",
]
