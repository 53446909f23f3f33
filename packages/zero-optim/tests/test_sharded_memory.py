"""Bytes per rank for parameters, gradients and optimizer state equal each stage's formula.

bf16 parameters, fp32 gradients and AdamW. With P the padded layout (``bucket_info``'s
last end) and O the parameter elements this rank owns:

- optimizer (ZeRO-1): params 2P, grads 4P, masters 4P/dp;
- gradients (ZeRO-2): params 2P, grads 4P/dp (each bucket's full gradients freed once
  reduced), masters 4P/dp;
- parameters (ZeRO-3): params 2P/dp (gathered buckets freed), grads 4P/dp, masters 4P/dp;

and Adam's state 8·O plus one 4-byte ``step`` per owned piece, for every stage. Measured
after a step from the storages actually allocated, and during backward (ZeRO-2/3: at most
three buckets' full gradients alive beside the shards: two reducing, one accumulating).
HSDP (dp 4 as dp_shard 2 x dp_replicate 2): the same formulas with dp_shard in place of dp.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_zero_optim import DistributedDataParallel, DistributedOptimizer, owned_pieces

WIDTH, LAYERS, BUCKET = 24, 8, 500  # 600 elements per layer: a bucket each


def _measure(sharding: str, dp_shard: int | None = None) -> dict[str, int]:
    groups = init_process_groups(ParallelConfig(dp_shard=dp_shard))
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    net = net.to(rank_device()).to(torch.bfloat16)
    ddp = DistributedDataParallel(
        net,
        dp_group=groups.dp_shard,
        replicate_group=None if dp_shard is None else groups.dp_replicate,
        bucket_size=BUCKET,
        sharding=sharding,
        prefetch=0,
    )
    opt = DistributedOptimizer(torch.optim.AdamW(ddp.parameters(), lr=1e-3), ddp)
    peak = 0

    def watch(_: torch.Tensor) -> None:
        nonlocal peak
        peak = max(peak, opt.memory_report().grad_bytes)

    for p in net.parameters():
        p.register_post_accumulate_grad_hook(watch)
    x = torch.randn(8, WIDTH, device=rank_device(), dtype=torch.bfloat16)
    opt.zero_grad()
    F.mse_loss(ddp(x).float(), x.float()).backward()
    opt.step()
    report = opt.memory_report()
    dp = ddp.dp_size
    [buffer] = ddp.param_and_grad_buffers
    owned = [
        piece
        for bucket in buffer.buckets
        for piece in owned_pieces(buffer.ranges, bucket.shard)  # type: ignore[union-attr]
    ]
    return {
        "dp": dp,
        "replica": groups.rank("dp_replicate"),
        "padded": ddp.bucket_info()[-1].end,
        "bucket": max(i.end - i.start for i in ddp.bucket_info()),
        "owned": sum(p.in_buffer.size for p in owned),
        "pieces": len(owned),
        "num_params": report.num_params,
        "param": report.param_bytes,
        "grad": report.grad_bytes,
        "master": report.master_bytes,
        "state": report.state_bytes,
        "peak_grad": peak,
    }


@pytest.mark.parametrize(("world", "dp_shard"), [(2, None), (4, None), (4, 2)])
@pytest.mark.parametrize("sharding", ["optimizer", "gradients", "parameters"])
def test_memory_matches_formula(
    dist_pool: DistPool, sharding: str, world: int, dp_shard: int | None
) -> None:
    results = dist_pool.run(_measure, world, args=(sharding, dp_shard))
    for r in results:
        padded, dp = r["padded"], r["dp"]
        assert dp == (world if dp_shard is None else dp_shard)
        assert r["num_params"] == LAYERS * (WIDTH * WIDTH + WIDTH)
        param = {"optimizer": 2 * padded, "gradients": 2 * padded, "parameters": 2 * padded // dp}
        grad = {"optimizer": 4 * padded, "gradients": 4 * padded // dp}.get(
            sharding, 4 * padded // dp
        )
        assert r["param"] == param[sharding]
        assert r["grad"] == grad
        assert r["master"] == 4 * padded // dp
        assert r["state"] == 8 * r["owned"] + 4 * r["pieces"]
        if sharding == "optimizer":
            assert r["peak_grad"] == 4 * padded
        else:  # the shards plus the full gradients of at most 3 buckets (2 reducing)
            assert 4 * padded // dp < r["peak_grad"] <= 4 * padded // dp + 3 * 4 * r["bucket"]
            assert r["peak_grad"] < 4 * padded
    first_replica = [r for r in results if r["replica"] == 0]  # the others hold the same
    assert len(first_replica) == (world if dp_shard is None else dp_shard)
    assert sum(r["owned"] for r in first_replica) == LAYERS * (WIDTH * WIDTH + WIDTH)
