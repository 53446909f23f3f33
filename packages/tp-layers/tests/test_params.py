"""``KeepsParamAttrs`` keeps every ``mega_*`` attribute through ``to_empty``; the SP gradient
sum reads ``main_grad`` where a DDP wrapper gave one. (The layers' own metadata after
``to_empty`` is tested in test_shard.py.)"""

from __future__ import annotations

import torch
from torch import nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool
from mega_tp_layers import (
    KeepsParamAttrs,
    ShardSpec,
    gradient_of,
    mark_sequence_parallel,
    set_shard_spec,
    shard_spec,
    sync_sequence_parallel_grads,
)


class _Block(KeepsParamAttrs):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(4, device="meta"))
        self.child = nn.Linear(4, 4, device="meta")  # a plain child: its parent keeps its attrs


def test_every_mega_attribute_survives_to_empty() -> None:
    block = _Block()
    spec = ShardSpec(
        dim=None, num_shards=1, shard_rank=0, group="tp", full_shape=(4,), duplicate=False
    )
    set_shard_spec(block.scale, spec)
    mark_sequence_parallel(block.scale)
    block.child.weight.mega_expert = "any mega_* value"  # type: ignore[attr-defined]
    block.child.weight.other = 1  # type: ignore[attr-defined]
    block.to_empty(device="cpu")
    assert block.scale.device.type == "cpu" and shard_spec(block.scale) == spec
    assert block.scale.mega_sequence_parallel is True  # type: ignore[attr-defined]
    assert block.child.weight.mega_expert == "any mega_* value"  # type: ignore[attr-defined]
    assert not hasattr(block.child.weight, "other")  # only mega metadata is carried over


def test_gradient_of_prefers_main_grad() -> None:
    p = nn.Parameter(torch.zeros(2))
    assert gradient_of(p) is None
    p.grad = torch.ones(2)
    assert gradient_of(p) is p.grad
    p.main_grad = torch.full((2,), 3.0)  # type: ignore[attr-defined]
    assert gradient_of(p) is p.main_grad  # type: ignore[attr-defined]


def _sync_main_grads() -> None:
    tp = init_process_groups(ParallelConfig(tp=2)).tp
    rank = torch.distributed.get_rank(tp)
    marked, other = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    mark_sequence_parallel(marked)
    for p in (marked, other):
        p.main_grad = torch.full((3,), float(rank + 1))  # type: ignore[attr-defined]
    assert sync_sequence_parallel_grads([marked, other], tp) == 1
    assert torch.equal(marked.main_grad, torch.full((3,), 3.0))  # type: ignore[attr-defined]
    assert torch.equal(other.main_grad, torch.full((3,), float(rank + 1)))  # type: ignore[attr-defined]
    assert marked.grad is None


def test_sync_sequence_parallel_grads_sums_main_grad(dist_pool: DistPool) -> None:
    dist_pool.run(_sync_main_grads, 2)
