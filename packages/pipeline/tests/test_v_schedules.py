"""Contract: ZBV and DualPipeV give the losses and gradients of plain gradient accumulation.

A stack of ``2 pp`` blocks (LayerNorm -> ColumnParallelLinear -> tanh -> RowParallelLinear,
tp 1) is cut into ``2 pp`` virtual stages; rank ``r`` holds stage ``r`` as chunk 0 and
stage ``2 pp - 1 - r`` as chunk 1 (the V). Every forward runs inside
``mega_tp_layers.defer_weight_grads``, so the linears' weight gradients come in W while the
norms' come in B. Each rank also runs plain gradient accumulation on the whole stack as
the reference. Checked for p in {2, 4}, m in {p, 2p, 4p} (DualPipeV from 2p): losses,
gradients, the executed F/B/W order against the pure order, the activations in flight
per rank (ZBV <= 2 pp chunks, DualPipeV <= 2 pp + 1), and the gradient-sync hook (once per
chunk, after its last B and W; every other B and W under ``no_sync``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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
    dualpipev_order,
    forward_backward_dualpipev,
    forward_backward_zbv,
    peak_in_flight,
    zbv_order,
    zbv_stage,
)

H = 8
SHAPE = (2, 3, H)  # [s, b, h]


def _n(layers: int, m: int) -> int:
    """The chain behind one element: 2 GEMMs of H and one norm per block, forward and back,
    then the tokens of m microbatches for a weight gradient."""
    return 2 * 3 * layers * H + m * SHAPE[0] * SHAPE[1]


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
    """Logs every F, B and W pass (with the chunk that was under no_sync) and each sync."""

    def __init__(self) -> None:
        self.trace: list[tuple[Any, ...]] = []
        self.no_sync: int | None = None
        self.current: tuple[int, int] = (-1, -1)

    def forward_step(self, it: Iterator[Any] | None, chunk: StageChunk) -> tuple[Tensor, LossFunc]:
        assert it is not None
        mb, x, y = next(it)
        assert mb == chunk.microbatch
        key = (mb, chunk.chunk)
        self.current = key
        self.trace.append(("F", *key))
        out = chunk(x)
        out.register_hook(lambda g: self.trace.append(("B", *key, self.no_sync)) or None)
        return out, lambda o: F.mse_loss(o, y)

    @contextlib.contextmanager
    def split_backward(self) -> Iterator[Any]:
        from mega_tp_layers import defer_weight_grads

        with defer_weight_grads() as store:
            logged = _Logged(store, self)
            yield logged
        logged.key = self.current

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
    def __init__(self, store: Any, rec: _Recorder) -> None:
        self.store, self.rec = store, rec
        self.key = (-1, -1)

    def run(self) -> None:
        assert len(self.store) > 0, "the linears deferred their W"
        self.rec.trace.append(("W", *self.key, self.rec.no_sync))
        self.store.run()


_SCHEDULES: dict[str, tuple[Callable[..., Any], Callable[[int, int, int], list[Action]], int]] = {
    # name: (schedule, order, extra chunks in flight beyond 2 pp)
    "zbv": (forward_backward_zbv, zbv_order, 0),
    "dualpipev": (forward_backward_dualpipev, dualpipev_order, 1),
}


def _check_v(name: str, split: bool) -> None:
    schedule, order, extra = _SCHEDULES[name]
    pp_group, tp_group, rank = _groups()
    pp = dist.get_world_size(pp_group)
    comm = P2PCommunicator(pp_group, tensor_shape=SHAPE, dtype=torch.float32)
    layers = 2 * pp
    stages = [zbv_stage(pp, rank, c) for c in (0, 1)]  # one block per virtual stage
    chunks = [_Block(tp_group, s) for s in stages]  # weights drawn by name
    counts = (pp, 2 * pp, 4 * pp) if name == "zbv" else (2 * pp, 4 * pp)
    for m in counts:
        gen = torch.Generator().manual_seed(m)
        batches = [(torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen))
                   for _ in range(m)]  # fmt: skip
        ref = nn.Sequential(*[_Block(tp_group, i) for i in range(layers)])
        ref_losses = []
        for x, y in batches:
            loss = F.mse_loss(ref(x), y)
            (loss / m).backward()
            ref_losses.append(loss.detach())
        for c in chunks:
            c.zero_grad(set_to_none=True)
        rec = _Recorder()
        items = [(i, x, y) for i, (x, y) in enumerate(batches)]
        losses = schedule(
            forward_step=rec.forward_step,
            data_iterator=[iter(items), iter(items)],
            model=chunks,
            num_microbatches=m,
            communicator=comm,
            grad_sync_func=rec.grad_sync,
            no_sync_func=rec.no_sync_ctx,
            split_backward=rec.split_backward if split else None,
        )
        assert (len(losses) == m) == (rank == 0)  # chunk 1 of rank 0 is the last stage
        shared = torch.stack([d["loss"] for d in broadcast_losses(losses, pp_group, src=0)])
        n = _n(layers, m)
        assert_close_to_reference(shared, torch.stack(ref_losses), reduction_length=n, name="loss")
        ref_params = dict(ref.named_parameters())
        for c, s in zip(chunks, stages, strict=True):
            for pname, p in c.named_parameters():
                expected = ref_params[f"{s}.{pname}"].grad
                assert p.grad is not None and expected is not None, pname
                assert_close_to_reference(p.grad, expected, reduction_length=n, name=pname)
        passes = [Action(e[0], e[1], e[2]) for e in rec.trace if e[0] in "FBW"]
        pure = order(pp, rank, m)
        expected_order = pure if split else [a for a in pure if a.kind != "W"]
        assert passes == expected_order, (passes, expected_order)
        assert peak_in_flight(passes) <= 2 * pp + extra
        for chunk in (0, 1):
            assert rec.trace.count(("sync", chunk)) == 1
            at = rec.trace.index(("sync", chunk))
            grads = [e for e in rec.trace if e[0] in "BW" and e[2] == chunk]
            assert all(rec.trace.index(e) < at for e in grads[-2:])
            for kind in {e[0] for e in grads}:  # the chunk's last B and W sync, the rest not
                modes = [e[3] for e in grads if e[0] == kind]
                assert modes == [chunk] * (len(modes) - 1) + [None], (kind, chunk, modes)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_v_schedule_matches_gradient_accumulation(dist_pool: DistPool, name: str, pp: int) -> None:
    dist_pool.run(_check_v, pp, args=(name, True))


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_v_schedule_fused_backward(dist_pool: DistPool, name: str) -> None:
    dist_pool.run(_check_v, 2, args=(name, False))


@pytest.mark.parametrize("schedule", [forward_backward_zbv, forward_backward_dualpipev])
def test_v_schedule_takes_two_chunks(schedule: Callable[..., Any]) -> None:
    with pytest.raises(ValueError, match="runs two chunks per rank in a V, but the model has 1"):
        schedule(
            forward_step=lambda it, c: (torch.zeros(()), lambda o: o),
            data_iterator=None,
            model=nn.Linear(1, 1),
            num_microbatches=1,
        )


def _check_variable_shapes_refused() -> None:
    group = dist.new_group([0])
    comm = P2PCommunicator(group, variable_shapes=True)
    with pytest.raises(ValueError, match="sends activations both ways, which needs a fixed"):
        forward_backward_zbv(
            forward_step=lambda it, c: (torch.zeros(()), lambda o: o),
            data_iterator=[None, None],
            model=[nn.Linear(1, 1), nn.Linear(1, 1)],
            num_microbatches=1,
            communicator=comm,
        )


def test_v_schedule_refuses_variable_shapes(dist_pool: DistPool) -> None:
    dist_pool.run(_check_variable_shapes_refused, 1)
