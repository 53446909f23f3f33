"""Two DistributedDataParallel wrappers of one module: ``param_filter`` and ``grad_scale``.

The mixture-of-experts layout: some parameters are reduced over one group, the rest over
another, each wrapper owning the parameters its filter selects. Here both groups are the
same dp group, one wrapper averaging (``"mean"``) and the other summing with
``grad_scale = 1/dp``; together they must equal one plain wrapper, gradients and AdamW
steps. The gradients (each rank's owned shard under the distributed optimizer, all of them
otherwise) and the optimizer's gradient norm are compared with plain autograd over the whole
global batch: AdamW's update hardly changes when a gradient is scaled by a constant, so the
weights alone would not notice a wrong ``grad_scale``. fp32 on CPU: the rounding bound of
``assert_close_to_reference`` (the same per-sample gradients summed in another order, scaled
by a power of two; n = ``N``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_zero_optim import DistributedDataParallel, DistributedOptimizer, StepResult

WIDTH = 8
N = 2 * (2 * 4 * WIDTH + 4 * 4)  # two steps of four layers forward and back, then the batch


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 2)
    ).to(rank_device())


def _is_middle(name: str, _: nn.Parameter) -> bool:
    return name.startswith("2.")


def _data(dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(4 * dp, WIDTH, generator=g), torch.randn(4 * dp, 2, generator=g)


def _global_grads(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Plain autograd on a copy of ``net``: the gradient of the mean loss over the global batch."""
    plain = _net()
    plain.load_state_dict(net.state_dict())
    F.mse_loss(plain(x.to(rank_device())), y.to(rank_device())).backward()
    return {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}


def _prefixed(where: str) -> Callable[[str], str]:
    return lambda message: f"{where}: {message}"


def _check_grads(
    net: nn.Module, opt: DistributedOptimizer, expected: dict[str, torch.Tensor], distributed: bool
) -> None:
    """Each rank's reduced gradients: its owned pieces (distributed optimizer), else all."""
    pieces = opt.state_dict()["params"]  # keyed "<wrapper>.<name>" with two wrappers
    owned = {k.split(".", 1)[1]: v["pieces"] for k, v in pieces.items()}
    assert owned.keys() == expected.keys()
    for name, p in net.named_parameters():
        got, want = p.main_grad.flatten(), expected[name].flatten()  # type: ignore[attr-defined]
        ranges = [(q["start"], q["end"]) for q in owned[name]] if distributed else [(0, p.numel())]
        for start, end in ranges:
            where = f"{name}[{start}:{end}]"
            assert_close_to_reference(
                got[start:end], want[start:end], reduction_length=N, name=where,
                scale=float(want.abs().max()),  # the whole tensor's scale, not the slice's
            )  # fmt: skip


def _split_wrappers(distributed: bool) -> dict[str, object]:
    groups = init_process_groups(ParallelConfig())
    dp, rank = dist.get_world_size(groups.dp), dist.get_rank(groups.dp)
    common = {"dp_group": groups.dp, "bucket_size": 40, "use_distributed_optimizer": distributed}
    net = _net()
    rest = DistributedDataParallel(net, param_filter=lambda n, p: not _is_middle(n, p), **common)  # type: ignore[arg-type]
    middle = DistributedDataParallel(
        net,
        param_filter=_is_middle,
        grad_reduce="sum",
        grad_scale=1.0 / dp,
        **common,  # type: ignore[arg-type]
    )
    owned = {
        "rest": sorted({n for i in rest.bucket_info() for n in i.params}),
        "middle": sorted({n for i in middle.bucket_info() for n in i.params}),
    }
    ref = _net()
    ref_ddp = DistributedDataParallel(ref, **common)  # type: ignore[arg-type]
    opt = DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2), [rest, middle])
    ref_opt = DistributedOptimizer(torch.optim.AdamW(ref.parameters(), lr=1e-2), ref_ddp)
    x, y = _data(dp)
    mine = slice(4 * rank, 4 * rank + 4)
    for _ in range(2):
        expected = _global_grads(net, x, y)
        results: list[StepResult] = []
        for model, o in ((net, opt), (ref, ref_opt)):
            o.zero_grad()
            F.mse_loss(model(x[mine].to(rank_device())), y[mine].to(rank_device())).backward()
            if model is net:
                for ddp in (rest, middle):
                    ddp.finish_grad_sync()
                _check_grads(net, opt, expected, distributed)
            results.append(o.step())
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in expected.values()])))
        for result in results:
            assert_close_to_reference(
                torch.tensor(result.grad_norm), torch.tensor(norm), reduction_length=N,
                name="grad norm",
            )  # fmt: skip
    for (name, p), r in zip(net.named_parameters(), ref.parameters(), strict=True):
        assert_close_to_reference(p, r, reduction_length=N, name=name)
    return owned


@pytest.mark.parametrize("distributed", [True, False])
def test_filtered_wrappers_equal_one_wrapper(dist_pool: DistPool, distributed: bool) -> None:
    owned = dist_pool.run(_split_wrappers, 2, args=(distributed,))[0]
    assert owned == {
        "rest": ["0.bias", "0.weight", "4.bias", "4.weight"],
        "middle": ["2.bias", "2.weight"],
    }


def _scaled_on_one_rank() -> None:
    groups = init_process_groups(ParallelConfig())
    net = _net()
    ddp = DistributedDataParallel(net, dp_group=groups.dp, grad_scale=0.25)
    ref = _net()
    x, y = _data(1)
    F.mse_loss(net(x.to(rank_device())), y.to(rank_device())).backward()
    ddp.finish_grad_sync()
    F.mse_loss(ref(x.to(rank_device())), y.to(rank_device())).backward()
    for p, r in zip(net.parameters(), ref.parameters(), strict=True):
        assert r.grad is not None
        assert_close_to_reference(p.main_grad, r.grad * 0.25, reduction_length=N, name="grad")  # type: ignore[attr-defined]


def test_grad_scale_applies_without_a_collective(dist_pool: DistPool) -> None:
    dist_pool.run(_scaled_on_one_rank, 1)


def _bad_scale(scale: object) -> str:
    groups = init_process_groups(ParallelConfig())
    try:
        DistributedDataParallel(_net(), dp_group=groups.dp, grad_scale=scale)  # type: ignore[arg-type]
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), True])
def test_bad_grad_scale(dist_pool: DistPool, scale: object) -> None:
    message = dist_pool.run(_bad_scale, 1, args=(scale,))[0]
    assert message.startswith(f"grad_scale ({scale!r}) must be a positive finite number")
    assert "\n" not in message


def _empty_filter() -> int:
    groups = init_process_groups(ParallelConfig())
    ddp = DistributedDataParallel(_net(), dp_group=groups.dp, param_filter=lambda n, p: False)
    ddp.zero_grad_buffer()
    ddp.finish_grad_sync()
    return len(ddp.bucket_info())


def test_a_filter_that_selects_nothing_gives_an_empty_wrapper(dist_pool: DistPool) -> None:
    assert dist_pool.run(_empty_filter, 2) == [0, 0]
