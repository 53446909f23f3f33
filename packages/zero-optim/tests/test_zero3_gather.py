"""ZeRO-3's gather schedule, traced: each bucket gathered before its use, freed after, prefetched.

A stack of LAYERS linear layers, one gather unit (and one bucket) each; one forward and
backward at dp 2 under ``trace_param_gathers``. The input does not require grad, so the
first layer's weight is not needed in backward (its bucket may be prefetched but never used).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_zero_optim import DistributedDataParallel, DistributedOptimizer

LAYERS, WIDTH = 6, 16


def _stack() -> nn.Sequential:
    mods: list[nn.Module] = []
    for _ in range(LAYERS):
        mods += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*mods).to(rank_device())


def _trace(prefetch: int) -> list[tuple[str, int]]:
    groups = init_process_groups(ParallelConfig())
    torch.manual_seed(0)
    ddp = DistributedDataParallel(
        _stack(), dp_group=groups.dp, bucket_size=None, sharding="parameters", prefetch=prefetch
    )
    opt = DistributedOptimizer(torch.optim.AdamW(ddp.parameters(), lr=1e-3), ddp)
    x = torch.randn(4, WIDTH, device=rank_device())
    for _ in range(2):  # the second step's trace: after an optimizer step
        opt.zero_grad()
        with ddp.trace_param_gathers() as log:
            loss = F.mse_loss(ddp(x), x)
            log.append(("backward", -1))
            loss.backward()
        opt.step()
    with torch.no_grad():  # evaluation: no backward will come, nothing stays gathered
        ddp(x)
    assert not any(b.gathered for buf in ddp.param_and_grad_buffers for b in buf.buckets)  # type: ignore[union-attr]
    return log


def _gathered_at_once(events: list[tuple[str, int]]) -> int:
    alive: set[int] = set()
    most = 0
    for kind, b in events:
        if kind == "gather":
            assert b not in alive, f"bucket {b} gathered twice without a free"
            alive.add(b)
        elif kind == "free":
            alive.discard(b)
        elif kind == "use":
            assert b in alive, f"bucket {b} used while not gathered"
        most = max(most, len(alive))
    assert not alive, f"buckets {sorted(alive)} still gathered after backward"
    return most


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_gather_order(dist_pool: DistPool, prefetch: int) -> None:
    log = dist_pool.run(_trace, 2, args=(prefetch,))[0]
    split = log.index(("backward", -1))
    forward, backward = log[:split], log[split + 1 :]
    # forward: units in order, each gathered once, before its use, and freed after it
    uses = [b for kind, b in forward if kind == "use"]
    assert uses == list(range(LAYERS))
    gathers = [b for kind, b in forward if kind == "gather"]
    assert sorted(gathers) == list(range(LAYERS))
    for b in range(LAYERS):
        assert forward.index(("gather", b)) < forward.index(("use", b)) < forward.index(("free", b))
    # prefetch: bucket b + k's gather is launched before bucket b is used (k <= prefetch)
    for b in range(LAYERS - prefetch):
        for k in range(1, prefetch + 1):
            assert forward.index(("gather", b + k)) < forward.index(("use", b))
    if prefetch == 0:
        for b in range(1, LAYERS):
            assert forward.index(("gather", b)) > forward.index(("free", b - 1))
    # backward: layers used in reverse (layer 0's weight is not needed), each gathered once
    uses = [b for kind, b in backward if kind == "use"]
    assert uses == list(range(LAYERS - 1, 0, -1))
    gathers = [b for kind, b in backward if kind == "gather"]
    assert len(gathers) == len(set(gathers))
    for b in uses:  # no gather of a bucket after its use
        assert backward.index(("gather", b)) < backward.index(("use", b))
    assert _gathered_at_once(forward) <= 1 + prefetch
    assert _gathered_at_once(backward) <= 1 + prefetch
