"""DistributedDataParallel mechanics: layout, overlap during backward, no_sync, modes, misuse.

Gradient comparisons are fp32 on CPU: the rounding bound of ``assert_close_to_reference``
(sums of the same per-sample gradients in another order; n = ``N``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_zero_optim import DistributedDataParallel, DistributedOptimizer

WIDTH = 16  # each Linear(16, 16) holds 272 parameters
N = 2 * 4 * WIDTH + 4 * 4  # four layers forward and back, then the batch (4 per rank, dp <= 4)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 4)).to(rank_device())


def _data(dp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, slice]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4 * dp, WIDTH, generator=g).to(rank_device())
    y = torch.randn(4 * dp, 4, generator=g).to(rank_device())
    return x, y, slice(4 * rank, 4 * rank + 4)


def _states(ddp: DistributedDataParallel) -> list[str]:
    return [info.state.value for info in ddp.bucket_info()]


def _overlap(overlap: bool) -> dict[str, Any]:
    groups = init_process_groups(ParallelConfig())
    ddp = DistributedDataParallel(
        _net(), dp_group=groups.dp, bucket_size=200, overlap_grad_reduce=overlap
    )
    x, y, mine = _data(ddp.dp_size, dist.get_rank())
    seen: dict[str, Any] = {}
    with ddp.no_sync():
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
    seen["after_no_sync"] = _states(ddp)
    first_out = ddp.module[0](x[mine])  # the gradient reaches here before layer 0's backward
    first_out.register_hook(lambda g: seen.__setitem__("before_first_layer", _states(ddp)))
    out = ddp.module[1:](first_out)
    F.mse_loss(out, y[mine]).backward()
    seen["after_backward"] = _states(ddp)
    ddp.finish_grad_sync()
    seen["after_finish"] = _states(ddp)
    return seen


@pytest.mark.parametrize("overlap", [True, False])
def test_buckets_reduce_during_backward(dist_pool: DistPool, overlap: bool) -> None:
    seen = dist_pool.run(_overlap, 2, args=(overlap,))[0]
    n = len(seen["after_finish"])
    assert n >= 4
    assert seen["after_no_sync"] == ["accumulating"] * n
    assert seen["after_finish"] == ["reduced"] * n
    if overlap:  # bucket 0 holds the last layer: reduced while backward is still running
        assert seen["before_first_layer"][0] == "reducing"
        assert seen["before_first_layer"][-1] == "accumulating"
        assert "accumulating" not in seen["after_backward"]
    else:
        assert seen["after_backward"] == ["accumulating"] * n


def _full_grads(grad_reduce: str) -> None:
    groups = init_process_groups(ParallelConfig())
    ddp = DistributedDataParallel(
        _net(),
        dp_group=groups.dp,
        bucket_size=100,
        use_distributed_optimizer=False,
        grad_reduce=grad_reduce,
    )
    dp = ddp.dp_size
    x, y, mine = _data(dp, dist.get_rank())
    F.mse_loss(ddp(x[mine]), y[mine]).backward()
    ddp.finish_grad_sync()
    ref = _net()
    F.mse_loss(ref(x), y).backward()  # mean over the whole batch
    factor = dp if grad_reduce == "sum" else 1
    for (name, p), r in zip(ddp.module.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is None
        assert_close_to_reference(p.main_grad, r.grad * factor, reduction_length=N, name=name)  # type: ignore[operator]


@pytest.mark.parametrize("grad_reduce", ["mean", "sum"])
def test_all_reduce_mode_gives_every_rank_the_full_gradient(
    dist_pool: DistPool, grad_reduce: str
) -> None:
    dist_pool.run(_full_grads, 4, args=(grad_reduce,))


def _misuse() -> str:
    groups = init_process_groups(ParallelConfig())
    ddp = DistributedDataParallel(_net(), dp_group=groups.dp, bucket_size=300)
    x, y, mine = _data(ddp.dp_size, dist.get_rank())
    F.mse_loss(ddp(x[mine]), y[mine]).backward()
    try:
        F.mse_loss(ddp(x[mine]), y[mine]).backward()  # a second synced backward, no zeroing
    except RuntimeError as exc:
        message = str(exc)
    else:
        message = "no error"
    ddp.zero_grad()  # waits for what is in flight and starts a clean step
    F.mse_loss(ddp(x[mine]), y[mine]).backward()
    ddp.finish_grad_sync()
    assert all(s == "reduced" for s in _states(ddp))
    return message


def test_gradient_after_reduction_is_an_error(dist_pool: DistPool) -> None:
    message = dist_pool.run(_misuse, 2)[0]
    assert "arrived after its bucket was reduced" in message
    assert "zero_grad_buffer()" in message and "no_sync()" in message


def _layout() -> dict[str, Any]:
    groups = init_process_groups(ParallelConfig())
    net = _net()
    net[2].to(torch.bfloat16)  # a second dtype: a second buffer
    net[2].bias.requires_grad_(False)
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    ddp = DistributedDataParallel(net, dp_group=groups.dp, bucket_size=None, grad_dtype=None)
    infos = ddp.bucket_info()
    return {
        "names": names,
        "buffers": [(str(i.param_dtype), str(i.grad_dtype), list(i.params)) for i in infos],
        "main_grad_dtype": str(net[2].weight.main_grad.dtype),
    }


def test_layout_reverse_registration_order_one_buffer_per_dtype(dist_pool: DistPool) -> None:
    got = dist_pool.run(_layout, 2)[0]
    fp32 = [n for n in reversed(got["names"]) if not n.startswith("2.")]
    assert got["buffers"] == [
        ("torch.float32", "torch.float32", fp32),
        ("torch.bfloat16", "torch.bfloat16", ["2.weight"]),
    ]
    assert got["main_grad_dtype"] == "torch.bfloat16"


def _broadcast() -> list[float]:
    groups = init_process_groups(ParallelConfig())
    torch.manual_seed(100 + dist.get_rank())  # replicas start different
    net = nn.Linear(4, 4).to(rank_device())
    DistributedDataParallel(net, dp_group=groups.dp)
    return net.weight.detach().cpu().flatten().tolist()


def test_parameters_broadcast_from_dp_rank_0(dist_pool: DistPool) -> None:
    weights = dist_pool.run(_broadcast, 4)
    assert all(w == weights[0] for w in weights)
    torch.manual_seed(100)
    assert weights[0] == nn.Linear(4, 4).weight.detach().flatten().tolist()


def _no_collectives() -> None:
    groups = init_process_groups(ParallelConfig())

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a size-1 group issued a collective")

    names = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast")
    saved = {name: getattr(dist, name) for name in names}
    for name in names:
        setattr(dist, name, forbidden)
    try:
        ddp = DistributedDataParallel(_net(), dp_group=groups.dp, bucket_size=100)
        opt = DistributedOptimizer(torch.optim.AdamW(ddp.parameters()), ddp, max_grad_norm=1.0)
        x, y, _ = _data(1, 0)
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        assert opt.step().updated
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def test_size_one_group_costs_no_collective(dist_pool: DistPool) -> None:
    dist_pool.run(_no_collectives, 1)


def _gather_overlap() -> dict[str, list[bool]]:
    groups = init_process_groups(ParallelConfig())
    ddp = DistributedDataParallel(_net(), dp_group=groups.dp, bucket_size=200)
    opt = DistributedOptimizer(torch.optim.AdamW(ddp.parameters()), ddp, overlap_param_gather=True)
    x, y, mine = _data(ddp.dp_size, dist.get_rank())
    seen: dict[str, list[bool]] = {}
    ddp.module[0].register_forward_pre_hook(  # runs after the DDP hook of the same module
        lambda m, a: seen.__setitem__("at_first_layer", _pending(ddp))
    )
    opt.zero_grad()
    F.mse_loss(ddp(x[mine]), y[mine]).backward()
    opt.step()
    seen["after_step"] = _pending(ddp)
    ddp(x[mine])
    seen["after_forward"] = _pending(ddp)
    return seen


def _pending(ddp: DistributedDataParallel) -> list[bool]:
    return [info.param_gather_pending for info in ddp.bucket_info()]


def test_param_gather_waits_for_the_forward(dist_pool: DistPool) -> None:
    seen = dist_pool.run(_gather_overlap, 2)[0]
    n = len(seen["after_step"])
    assert seen["after_step"] == [True] * n  # step() returns with every all-gather in flight
    assert seen["after_forward"] == [False] * n
    # entering the first layer, only the bucket of its parameters (the last) was waited for;
    # the first bucket (the last layers) is still in flight
    assert seen["at_first_layer"][-1] is False and seen["at_first_layer"][0] is True
