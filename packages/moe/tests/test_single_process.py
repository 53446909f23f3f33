"""Without groups (or with one-rank groups) the layer needs no torch.distributed at all."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from mega_moe import MoEConfig, MoELayer, RouterConfig, moe_aux_loss, moe_tokens_per_expert
from mega_parallel_grid.testing import DistPool, rank_device, solo_groups

H = 16
CFG = MoEConfig(
    router=RouterConfig(
        num_experts=4,
        top_k=2,
        aux_loss_coeff=0.1,
        seq_aux_loss_coeff=0.1,
        z_loss_coeff=0.01,
        capacity_factor=1.0,
        pad_to_capacity=True,
    ),
    ffn_hidden_size=32,
    shared_ffn_size=16,
    shared_expert_gate=True,
)
COLLECTIVES = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather",
    "all_to_all_single",
    "broadcast",
    "reduce_scatter",
)


@contextmanager
def count_collectives() -> Iterator[list[str]]:
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _step(layer: MoELayer, device: torch.device) -> None:
    x = torch.randn(6, 2, H, device=device, requires_grad=True)
    y = layer(x)
    loss = moe_aux_loss(layer)
    assert loss is not None and loss.requires_grad
    (y.square().mean() + loss).backward()
    assert all(p.grad is not None for p in layer.parameters())
    counts = moe_tokens_per_expert(layer)
    assert counts is not None and counts.shape == (1, 4)


def test_plain_pytorch_without_distributed() -> None:
    assert not dist.is_initialized()
    _step(MoELayer(H, CFG, seed=0), torch.device("cpu"))


def _one_rank_groups_issue_nothing(dispatcher: str) -> int:
    g = solo_groups()
    router = replace(CFG.router, pad_to_capacity=dispatcher == "alltoall")
    cfg = MoEConfig(router=router, ffn_hidden_size=32, shared_ffn_size=16, dispatcher=dispatcher)  # type: ignore[arg-type]
    layer = MoELayer(
        H,
        cfg,
        ep_group=g.ep,
        etp_group=g.etp,
        tp_group=g.tp,
        sequence_parallel=True,
        seed=0,
        device=rank_device(),
    )
    with count_collectives() as calls:
        _step(layer, rank_device())
    return len(calls)


def test_one_rank_groups_issue_no_collective(dist_pool: DistPool) -> None:
    for dispatcher in ("alltoall", "allgather"):
        assert dist_pool.run(_one_rank_groups_issue_nothing, 1, args=(dispatcher,)) == [0]
