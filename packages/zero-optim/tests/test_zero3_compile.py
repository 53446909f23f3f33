"""ZeRO-3 with each gather unit compiled (``module.compile()``, as the trainer's layers).

The gather hooks stay out of the compiled graphs (no graph break, counted; no collective or
storage resize inside a graph); the units' saved parameters are gathered again in backward. Two
steps of a stack of compiled blocks at dp 2 equal the same stack on one process, eager.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.compile_fx import compile_fx

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_zero_optim import DistributedDataParallel, DistributedOptimizer

BLOCKS, WIDTH, BATCH, STEPS = 3, 16, 4, 2


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_Block() for _ in range(BLOCKS)], nn.Linear(WIDTH, WIDTH))


def _data(step: int, dp: int, rank: int) -> torch.Tensor:
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(step))
    return x[rank::dp].to(rank_device())


def _train(compile_: bool) -> tuple[list[float], dict[str, torch.Tensor], int, list[str]]:
    groups = init_process_groups(ParallelConfig())
    dp, rank = groups.size("dp"), groups.rank("dp")
    model = _model().to(rank_device())
    blocks = list(model)[:BLOCKS]
    graphs: list[str] = []

    def inductor(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        graphs.append(str(gm.graph))
        return compile_fx(gm, inputs)

    if compile_:
        for block in blocks:
            block.compile(backend=inductor)
    ddp = DistributedDataParallel(
        model, dp_group=groups.dp, bucket_size=None, sharding="parameters", gather_units=blocks
    )
    opt = DistributedOptimizer(torch.optim.AdamW(ddp.parameters(), lr=1e-3, eps=1e-5), ddp)
    torch._dynamo.utils.counters.clear()
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x = _data(step, dp, rank)
        loss = F.mse_loss(ddp(x), x.flip(-1))  # the DDP averages the gradients over dp
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=groups.dp)
        losses.append(float(total) / dp)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    torch._dynamo.reset()
    with ddp.gathered_parameters():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, weights, breaks, graphs


def test_compiled_units_train_like_one_process(dist_pool: DistPool) -> None:
    [(ref_losses, ref_weights, _, _)] = dist_pool.run(_train, 1, args=(False,))
    results = dist_pool.run(_train, 2, args=(True,), timeout=600)
    for losses, weights, breaks, graphs in results:
        # fp32: dp 2 sums two halves of the batch; the compiler fuses the same arithmetic
        assert_close_to_reference(
            torch.tensor(losses), torch.tensor(ref_losses), reduction_length=BATCH * WIDTH,
            name="losses",
        )  # fmt: skip
        for name, value in weights.items():
            assert_close_to_reference(
                value, ref_weights[name], reduction_length=STEPS * BATCH * 2 * WIDTH, name=name
            )
        # the gather hooks run outside the graphs: no collective, no storage resize inside
        assert graphs, "nothing was compiled"
        for graph in graphs:
            assert "all_gather" not in graph and "resize" not in graph, graph
        assert breaks == 0 and len(graphs) == 2, (breaks, len(graphs))  # one block's fwd, bwd
