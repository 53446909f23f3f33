"""Split backward (B now, W later) of the parallel linears == their fused backward, bit for bit.

A LayerNorm -> Column -> GELU -> Row block runs its backward twice from the same weights
and output gradient: fused, and with the forward inside ``defer_weight_grads`` so that
backward computes input gradients only and ``store.run()`` the weight gradients. In fp32
on the CPU both compute the same GEMMs in the same order, so every gradient must be
*equal*, at tp 1 and tp 2 with and without sequence parallel. Under mega-zero-optim's
DistributedDataParallel the deferred weights' buckets must start their reduction only
in the W pass, and every bucket exactly once per step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tp_testing import recorded_dist_calls
from torch import Tensor, nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool
from mega_tp_layers import (
    ColumnParallelLinear,
    Normal,
    RowParallelLinear,
    defer_weight_grads,
    shard_tensor,
)

S, B, H, FFN = 8, 2, 16, 32


class _Block(nn.Module):
    def __init__(self, g: dist.ProcessGroup, sp: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.fc1 = ColumnParallelLinear(
            H, FFN, tp_group=g, sequence_parallel=sp, init_method=Normal(0.3), seed=3, name="fc1"
        )
        self.fc2 = RowParallelLinear(
            FFN, H, tp_group=g, sequence_parallel=sp, init_method=Normal(0.3), seed=3, name="fc2"
        )
        with torch.no_grad():
            self.fc1.bias.normal_(generator=torch.Generator().manual_seed(5))  # type: ignore[union-attr]

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _grads(block: nn.Module, x: Tensor) -> dict[str, Tensor]:
    out = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    assert x.grad is not None
    out["input"] = x.grad.clone()
    return out


def _check_split_equals_fused(tp: int, sp: bool) -> None:
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank = dist.get_rank(g)
    block = _Block(g, sp)
    x_full, dy_full = torch.randn(S, B, H), torch.randn(S, B, H)
    x0 = shard_tensor(x_full, 0, rank, tp) if sp else x_full
    dy = shard_tensor(dy_full, 0, rank, tp) if sp else dy_full

    x = x0.clone().requires_grad_()
    y_fused = block(x)
    y_fused.backward(dy)
    fused = _grads(block, x)
    block.zero_grad(set_to_none=True)

    x = x0.clone().requires_grad_()
    with defer_weight_grads() as store:
        y = block(x)
    assert torch.equal(y, y_fused), "the split forward computes the same output"
    y.backward(dy)
    linears = {"fc1.weight", "fc1.bias", "fc2.weight"}  # and at tp 1 the row bias (one GEMM)
    early = {n for n, p in block.named_parameters() if p.grad is not None}
    fused_in_b = {"norm.weight", "norm.bias"} | ({"fc2.bias"} if tp > 1 else set())
    assert early == fused_in_b, f"B gave grads to {early}, expected {fused_in_b}"
    assert len(store) == 2, f"expected fc1 and fc2 deferred, got {len(store)}"
    store.run()
    assert len(store) == 0
    split = _grads(block, x)
    assert split.keys() == fused.keys(), (split.keys(), fused.keys())
    for name in fused:
        assert torch.equal(split[name], fused[name]), f"{name}: split != fused (tp {tp}, sp {sp})"
    assert linears <= split.keys()


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True)])
def test_split_backward_equals_fused(dist_pool: DistPool, tp: int, sp: bool) -> None:
    dist_pool.run(_check_split_equals_fused, tp, (tp, sp))


def _check_ddp_buckets(world: int) -> None:
    from mega_zero_optim import DistributedDataParallel

    groups = init_process_groups(ParallelConfig(tp=1))
    torch.manual_seed(7)
    block = _Block(groups.tp, False)
    ddp = DistributedDataParallel(block, dp_group=groups.dp, bucket_size=FFN * H)
    names = {id(p): n for n, p in block.named_parameters()}
    deferred = {"fc1.weight", "fc1.bias", "fc2.weight"}
    ddp.zero_grad_buffer()
    xs = [torch.randn(S, B, H) for _ in range(2)]
    with recorded_dist_calls(["reduce_scatter_tensor", "all_reduce"], lambda n, kw: n) as calls:
        stores = []
        for i, x in enumerate(xs):
            with defer_weight_grads() as store:
                y = ddp(x.requires_grad_())
            stores.append(store)
            if i == 0:
                with ddp.no_sync():
                    y.sum().backward()
                    store.run()
            else:
                y.sum().backward()  # the last B: sync enabled, deferred weights not arrived
        during_b = len(calls)
        waiting = [b for b in ddp.bucket_info() if b.state.value == "accumulating"]
        assert waiting and all(set(b.params) & deferred for b in waiting), waiting
        stores[-1].run()  # the last W: the remaining buckets start now
        assert all(b.state.value != "accumulating" for b in ddp.bucket_info())
        ddp.finish_grad_sync()
    assert len(calls) == len(ddp.bucket_info()), f"{calls} for {len(ddp.bucket_info())} buckets"
    assert during_b < len(calls), "some reduction must wait for the W pass"
    split = {n: p.main_grad.clone() for n, p in block.named_parameters()}  # type: ignore[operator]

    ddp.zero_grad_buffer()
    for i, x in enumerate(xs):
        y = ddp(x.detach().requires_grad_())
        if i == 0:
            with ddp.no_sync():
                y.sum().backward()
        else:
            y.sum().backward()
    ddp.finish_grad_sync()
    for p in block.parameters():
        name = names[id(p)]
        assert torch.equal(split[name], p.main_grad), f"{name}: split != fused under DDP"  # type: ignore[arg-type]


def test_ddp_buckets_fire_once_after_the_last_w(dist_pool: DistPool) -> None:
    dist_pool.run(_check_ddp_buckets, 2, (2,))
