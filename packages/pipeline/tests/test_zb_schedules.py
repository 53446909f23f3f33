"""Contract: ZB-H1 with a split backward gives the losses and gradients of gradient accumulation.

A stack of blocks (LayerNorm -> ColumnParallelLinear -> tanh -> RowParallelLinear, tp 1)
is cut into pp stages; every forward runs inside ``mega_tp_layers.defer_weight_grads``, so
the linears' weight gradients arrive in the W actions while the norms' come in B (a layer
without the split stays B+W fused). Each rank also runs plain gradient accumulation on the
whole stack as the reference. Checked for p in {2, 4}, m in {p, 2p}: losses and
gradients, the executed F/B/W order against :func:`~mega_pipeline.zb_h1_order`, the
gradient-sync hook (once per step, right after the last W, every B and W but the last
of each under ``no_sync``), and that without ``split_backward`` the schedule is 1F1B.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from mega_parallel_grid.testing import DistPool, assert_close_to_reference
from mega_pipeline import (
    Action,
    LossFunc,
    P2PCommunicator,
    StageChunk,
    broadcast_losses,
    forward_backward_zb_h1,
    one_f_one_b_order,
    rank_layer_ranges,
    zb_h1_order,
)

H, LAYERS = 8, 4
SHAPE = (2, 3, H)  # [s, b, h]
# the chain behind one element: 2 GEMMs of H and one norm of H per block, forward and back,
# then the tokens of up to 8 microbatches for a weight gradient
N = 2 * 3 * LAYERS * H + 8 * SHAPE[0] * SHAPE[1]


class _Block(nn.Module):
    def __init__(self, tp_group: ProcessGroup, index: int) -> None:
        from mega_tp_layers import ColumnParallelLinear, Normal, RowParallelLinear

        super().__init__()
        self.norm = nn.LayerNorm(H)
        init = Normal(0.5)
        self.fc1 = ColumnParallelLinear(
            H, 2 * H, tp_group=tp_group, init_method=init, seed=4, name=f"b{index}.fc1"
        )
        self.fc2 = RowParallelLinear(
            2 * H, H, tp_group=tp_group, init_method=init, seed=4, name=f"b{index}.fc2"
        )

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


def _groups() -> tuple[ProcessGroup, ProcessGroup, int]:
    """One pipeline over all ranks, and each rank alone as its tp group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    timeout = timedelta(seconds=60)
    pp = dist.new_group(list(range(world)), timeout=timeout)
    tp = None
    for r in range(world):
        g = dist.new_group([r], timeout=timeout)
        tp = g if r == rank else tp
    assert isinstance(pp, ProcessGroup) and isinstance(tp, ProcessGroup)
    return pp, tp, dist.get_rank(pp)


class _Recorder:
    def __init__(self, linears: int) -> None:
        self.trace: list[tuple[Any, ...]] = []
        self.no_sync: int | None = None
        self.linears = linears

    def forward_step(self, it: Iterator[Any] | None, chunk: StageChunk) -> tuple[Tensor, LossFunc]:
        assert it is not None
        mb, x, y = next(it)
        self.trace.append(("F", mb, chunk.chunk))
        out = chunk(x)
        if out.requires_grad:
            out.register_hook(lambda g: self.trace.append(("B", mb, 0, self.no_sync)) or None)
        return out, lambda o: F.mse_loss(o, y)

    @contextlib.contextmanager
    def split_backward(self) -> Iterator[Any]:
        from mega_tp_layers import defer_weight_grads

        with defer_weight_grads() as store:
            yield _Logged(store, self)

    @contextlib.contextmanager
    def no_sync_ctx(self, chunk: int) -> Iterator[None]:
        self.no_sync = chunk
        try:
            yield
        finally:
            self.no_sync = None

    def grad_sync(self, chunk: int) -> None:
        self.trace.append(("sync", chunk))


class _Logged:
    """A W pass that logs itself (its microbatch: the trace's F it belongs to)."""

    def __init__(self, store: Any, rec: _Recorder) -> None:
        self.store, self.rec = store, rec
        self.mb = sum(1 for e in rec.trace if e[0] == "F")  # the forward about to run

    def run(self) -> None:
        assert len(self.store) == self.rec.linears, "every linear deferred its W"
        self.rec.trace.append(("W", self.mb, 0, self.rec.no_sync))
        self.store.run()


def _check_zb_h1(split: bool) -> None:
    pp_group, tp_group, rank = _groups()
    pp = dist.get_world_size(pp_group)
    comm = P2PCommunicator(pp_group, tensor_shape=SHAPE, dtype=torch.float32)
    (mine,) = rank_layer_ranges(LAYERS, pp, rank)
    chunk = nn.Sequential(*[_Block(tp_group, i) for i in mine])  # weights drawn by name
    for m in (pp, 2 * pp):
        gen = torch.Generator().manual_seed(m)
        batches = [(torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen))]
        batches += [(torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen))
                    for _ in range(m - 1)]  # fmt: skip
        ref = nn.Sequential(*[_Block(tp_group, i) for i in range(LAYERS)])
        ref_losses = []
        for x, y in batches:
            loss = F.mse_loss(ref(x), y)
            (loss / m).backward()
            ref_losses.append(loss.detach())
        chunk.zero_grad(set_to_none=True)
        rec = _Recorder(linears=2 * len(mine))
        it = iter([(i, x, y) for i, (x, y) in enumerate(batches)])
        losses = forward_backward_zb_h1(
            forward_step=rec.forward_step,
            data_iterator=it,
            model=chunk,
            num_microbatches=m,
            communicator=comm,
            grad_sync_func=rec.grad_sync,
            no_sync_func=rec.no_sync_ctx,
            split_backward=rec.split_backward if split else None,
        )
        shared = torch.stack([d["loss"] for d in broadcast_losses(losses, pp_group)])
        assert_close_to_reference(shared, torch.stack(ref_losses), reduction_length=N, name="loss")
        ref_params = dict(ref.named_parameters())
        for name, p in chunk.named_parameters():
            index, rest = name.split(".", 1)
            expected = ref_params[f"{mine[int(index)]}.{rest}"].grad
            assert p.grad is not None and expected is not None, name
            assert_close_to_reference(p.grad, expected, reduction_length=N, name=name)
        # executed order == the pure order; the hook once, after the last W (or B)
        passes = [Action(e[0], e[1], e[2]) for e in rec.trace if e[0] in "FBW"]
        expected_order = zb_h1_order(pp, rank, m) if split else one_f_one_b_order(pp, rank, m)
        assert passes == expected_order, (passes, expected_order)
        assert rec.trace.count(("sync", 0)) == 1 and rec.trace[-1] == ("sync", 0)
        grads = [e for e in rec.trace if e[0] in "BW"]
        kinds = {k for k, *_ in grads}
        for kind in kinds:  # the chunk's last B and last W run with sync on, the rest off
            modes = [e[3] for e in grads if e[0] == kind]
            assert modes == [0] * (len(modes) - 1) + [None], (kind, modes)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_zb_h1_matches_gradient_accumulation(dist_pool: DistPool, pp: int, split: bool) -> None:
    dist_pool.run(_check_zb_h1, pp, args=(split,))


def test_zb_h1_takes_one_chunk() -> None:
    with pytest.raises(ValueError, match="runs one chunk per rank, but the model has 2"):
        forward_backward_zb_h1(
            forward_step=lambda it, c: (torch.zeros(()), lambda o: o),
            data_iterator=None,
            model=[nn.Linear(1, 1), nn.Linear(1, 1)],
            num_microbatches=1,
        )
