"""Contract: every schedule gives the losses and gradients of the unsplit stack.

A stack of 8 small layers (hidden 16) is split into pp*vpp virtual stages; each rank
also builds the whole stack and runs plain gradient accumulation over the same
microbatches as the reference. One rank-function call per (pp, vpp) checks, for
m in {pp, 2pp, 4pp}: losses and gradients, forward_only losses, the executed order of
forward and backward passes against the pure schedule, the gradient-sync hooks, the peak
number of microbatches in flight and the freeing of sent outputs (plain tensors, views and
outputs that autograd saved).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Iterator
from datetime import timedelta
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_pipeline import (
    Action,
    LossFunc,
    P2PCommunicator,
    StageChunk,
    broadcast_losses,
    get_forward_backward_func,
    interleaved_order,
    no_pipelining_order,
    one_f_one_b_order,
    peak_in_flight,
    rank_layer_ranges,
)
from mega_pipeline.memory import is_deallocated

H = 16
LAYERS = 8
SHAPE = (2, 3, H)  # [s, b, h]: activations are sequence-first
# fp32 on CPU: the same operations run in the same order on both sides; the rounding bound
# of ``assert_close_to_reference`` covers a backend that reorders a sum (reduction or gemm
# blocking): n is the stack's chain, H per layer forward and back, then the tokens of up to
# 16 microbatches for a weight gradient.
N = 2 * LAYERS * H + 16 * SHAPE[0] * SHAPE[1]


class _ViewOut(nn.Module):
    """``linear`` on the flattened tokens, its 2-D result viewed back: the output is a view."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: Tensor) -> Tensor:
        s, b, h = x.shape
        y: Tensor = self.linear(x.reshape(s * b, h))  # [s*b, h]
        return y.view(s, b, -1)  # [s*b, h] -> [s, b, h]: a view of the 2-D result


def _stack() -> list[nn.Module]:
    """Even layers end in tanh (its output saved for backward); odd ones in Linear (not
    saved): plain nn.Linear at i % 4 == 1, a view of a 2-D Linear result at i % 4 == 3."""
    gen = torch.Generator().manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(LAYERS):
        linear = nn.Linear(H, H)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(H, H, generator=gen) / H**0.5)
            linear.bias.copy_(torch.randn(H, generator=gen) * 0.1)
        if i % 2 == 0:
            layers.append(nn.Sequential(linear, nn.Tanh()))
        else:
            layers.append(nn.Sequential(nn.Tanh(), linear if i % 4 == 1 else _ViewOut(linear)))
    return layers


def _batches(m: int, seq_lens: list[int] | None = None) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(m):
        shape = SHAPE if seq_lens is None else (seq_lens[i], *SHAPE[1:])
        out.append((torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)))
    return out


def _reference(
    m: int, batches: list[tuple[Tensor, Tensor]], device: torch.device
) -> tuple[list[float], list[Tensor]]:
    """Plain gradient accumulation on the unsplit stack, on this rank's device."""
    model = nn.Sequential(*_stack()).to(device)
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x.to(device)), y.to(device))
        torch.autograd.backward(loss / m)
        losses.append(loss.item())
    return losses, [_grad(p).cpu() for p in model.parameters()]


def _grad(p: Tensor) -> Tensor:
    assert p.grad is not None
    return p.grad


class _Recorder:
    """forward_step plus the hooks, recording what runs in which order."""

    def __init__(self, device: torch.device, last_rank: bool) -> None:
        self.device = device
        self.trace: list[tuple[Any, ...]] = []
        self.no_sync: int | None = None
        self.live: list[tuple[weakref.ref[Tensor], weakref.ref[torch.UntypedStorage]]] = []
        self.peak_live = 0
        self.sync_grads: dict[int, list[Tensor]] = {}
        self.chunks: list[nn.Module] = []

    def forward_step(self, it: Iterator[Any] | None, chunk: StageChunk) -> tuple[Tensor, LossFunc]:
        assert it is not None
        mb, x, y = next(it)
        assert mb == chunk.microbatch, "each chunk reads its microbatches in order"
        assert (chunk.input_tensor is None) == chunk.is_first_stage
        self.trace.append(("F", mb, chunk.chunk))
        out = chunk(x.to(self.device))
        if out.requires_grad:
            ref, storage = weakref.ref(out), weakref.ref(out.untyped_storage())
            last = chunk.is_last_stage
            key = (mb, chunk.chunk)
            saved = isinstance(list(chunk.module.modules())[-1], nn.Tanh)

            def on_backward(grad: Tensor) -> None:
                t = ref()
                if saved:  # autograd holds the storage; the executor's tensor must not
                    freed = t is not None and is_deallocated(t)
                else:  # the memory itself is gone (a view was swapped for an alias and freed)
                    freed = storage() is None
                self.trace.append(("B", *key, self.no_sync, freed or last))

            out.register_hook(on_backward)
            # an output is live while its tensor object or its storage is
            self.live = [(r, s) for r, s in self.live if r() is not None or s() is not None]
            self.live.append((ref, storage))
            self.peak_live = max(self.peak_live, len(self.live))
        return out, partial(self.loss, y=y.to(self.device))

    @staticmethod
    def loss(out: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        loss = F.mse_loss(out, y)
        return loss, {"loss": loss.detach(), "out_mean": out.detach().mean()}

    def grad_sync(self, chunk: int) -> None:
        self.trace.append(("sync", chunk))
        self.sync_grads[chunk] = [_grad(p).clone() for p in self.chunks[chunk].parameters()]

    @contextlib.contextmanager
    def no_sync_ctx(self, chunk: int) -> Iterator[None]:
        assert self.no_sync is None
        self.no_sync = chunk
        try:
            yield
        finally:
            self.no_sync = None


def _expected_order(pp: int, vpp: int, rank: int, m: int, forward_only: bool) -> list[Action]:
    if pp == 1:
        return no_pipelining_order(m, forward_only)
    if vpp == 1:
        return one_f_one_b_order(pp, rank, m, forward_only)
    return interleaved_order(pp, vpp, rank, m, forward_only)


def _pp_group() -> tuple[ProcessGroup, int]:
    """All ranks form one pipeline (a plain group: these tests need no other dimension)."""
    group = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=60))
    assert isinstance(group, ProcessGroup)
    return group, dist.get_rank(group)


def _check_schedules(pp: int, vpp: int, variable: bool = False) -> list[float]:
    pp_group, rank = _pp_group()
    device = rank_device()
    comm = P2PCommunicator(
        pp_group,
        tensor_shape=None if variable else SHAPE,
        variable_shapes=variable,
        dtype=torch.float32,
    )
    layers = _stack()
    ranges = rank_layer_ranges(LAYERS, pp, rank, vpp)
    chunks: list[nn.Module] = [
        nn.Sequential(*[copy.deepcopy(layers[i]) for i in r]).to(device) for r in ranges
    ]
    schedule = get_forward_backward_func(pp, vpp)
    last_rank = rank == pp - 1
    all_losses: list[float] = []
    for m in (pp, 2 * pp, 4 * pp):
        seq_lens = [1 + i % 3 for i in range(m)] if variable else None
        batches = _batches(m, seq_lens)
        ref_losses, ref_grads = _reference(m, batches, device)
        for c in chunks:
            c.zero_grad(set_to_none=True)
        rec = _Recorder(device, last_rank)
        rec.chunks = chunks
        its = [iter([(i, x, y) for i, (x, y) in enumerate(batches)]) for _ in chunks]
        losses = schedule(
            forward_step=rec.forward_step,
            data_iterator=its if vpp > 1 else its[0],
            model=chunks if vpp > 1 else chunks[0],
            num_microbatches=m,
            communicator=comm,
            grad_sync_func=rec.grad_sync,
            no_sync_func=rec.no_sync_ctx,
        )
        # losses on the last stage only, equal to the reference; shared for logging
        assert len(losses) == (m if last_rank else 0)
        shared = broadcast_losses(losses, pp_group)
        got = torch.stack([d["loss"] for d in shared]).cpu()
        assert_close_to_reference(got, torch.tensor(ref_losses), reduction_length=N, name="losses")
        assert sorted(shared[0]) == ["loss", "out_mean"]
        all_losses += got.tolist()
        # gradients of this rank's layers equal the unsplit stack's
        for c, r in zip(chunks, ranges, strict=True):
            first = 2 * r.start  # two parameters (weight, bias) per layer
            for p, ref in zip(c.parameters(), ref_grads[first : 2 * r.stop], strict=True):
                assert_close_to_reference(_grad(p), ref, reduction_length=N, name="grad")
        # executed order == pure schedule (the textbook order is checked in test_order)
        executed = [Action(e[0], e[1], e[2]) for e in rec.trace if e[0] in ("F", "B")]
        expected = _expected_order(pp, vpp, rank, m, False)
        assert executed == expected
        # each chunk's sync hook fires once, right after its last backward, with final grads
        for ci, c in enumerate(chunks):
            syncs = [i for i, e in enumerate(rec.trace) if e == ("sync", ci)]
            backs = [i for i, e in enumerate(rec.trace) if e[0] == "B" and e[2] == ci]
            assert len(syncs) == 1 and syncs[0] == backs[-1] + 1
            for snap, p in zip(rec.sync_grads[ci], c.parameters(), strict=True):
                assert torch.equal(snap, _grad(p))
            # every backward of the chunk but the last runs with grad sync disabled
            modes = [rec.trace[i][3] for i in backs]
            assert modes == [ci] * (len(backs) - 1) + [None]
        # sent outputs were freed before their backward; in-flight bounded by the schedule
        assert all(e[4] for e in rec.trace if e[0] == "B")
        assert rec.peak_live <= peak_in_flight(expected)
        if vpp == 1:
            assert peak_in_flight(executed) == min(pp - rank, m)
        # forward_only: same losses, no gradients, forward order only
        for c in chunks:
            c.zero_grad(set_to_none=True)
        rec = _Recorder(device, last_rank)
        its = [iter([(i, x, y) for i, (x, y) in enumerate(batches)]) for _ in chunks]
        losses = schedule(
            forward_step=rec.forward_step,
            data_iterator=its if vpp > 1 else its[0],
            model=chunks if vpp > 1 else chunks[0],
            num_microbatches=m,
            communicator=comm,
            forward_only=True,
            grad_sync_func=rec.grad_sync,
        )
        if last_rank:
            got = torch.stack([d["loss"] for d in losses]).cpu()
            assert_close_to_reference(
                got, torch.tensor(ref_losses), reduction_length=N, name="forward-only losses"
            )
        assert all(p.grad is None for c in chunks for p in c.parameters())
        assert [Action(*e[:3]) for e in rec.trace] == _expected_order(pp, vpp, rank, m, True)
    return all_losses


@pytest.mark.parametrize(("pp", "vpp"), [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)])
def test_schedule_matches_gradient_accumulation(dist_pool: DistPool, pp: int, vpp: int) -> None:
    results = dist_pool.run(_check_schedules, pp, args=(pp, vpp))
    assert all(r == results[0] for r in results)  # every rank logged the same losses


def test_variable_shapes_match(dist_pool: DistPool) -> None:
    """Sequence length changes per microbatch; shapes travel ahead of each activation."""
    dist_pool.run(_check_schedules, 2, args=(2, 2, True))


def _check_split(split: list[int] | None, scale: float) -> None:
    """1F1B at pp 2 on stages of ``split`` layers (even when None), losses scaled by
    ``scale`` in backward: losses (unscaled) and gradients (scaled) equal one process's."""
    pp_group, rank = _pp_group()
    device = rank_device()
    comm = P2PCommunicator(pp_group, tensor_shape=SHAPE)
    layers = _stack()
    (r,) = rank_layer_ranges(LAYERS, 2, rank, split=split)
    chunk = nn.Sequential(*[layers[i] for i in r]).to(device)
    batches = _batches(4)
    ref_losses, ref_grads = _reference(4, batches, device)
    rec = _Recorder(device, rank == 1)
    losses = get_forward_backward_func(2)(
        forward_step=rec.forward_step,
        data_iterator=iter([(i, x, y) for i, (x, y) in enumerate(batches)]),
        model=chunk,
        num_microbatches=4,
        communicator=comm,
        grad_scale_func=(lambda loss: loss * scale) if scale != 1.0 else None,
    )
    if rank == 1:  # returned losses are unscaled
        assert_close_to_reference(
            torch.stack([d["loss"] for d in losses]), torch.tensor(ref_losses),
            reduction_length=N, name="unscaled losses",
        )  # fmt: skip
    params = list(chunk.parameters())
    assert len(params) == 2 * len(r)
    for p, ref in zip(params, ref_grads[2 * r.start : 2 * r.stop], strict=True):
        assert_close_to_reference(_grad(p), ref * scale, reduction_length=N, name="scaled grad")


def test_grad_scale_func_scales_gradients_only(dist_pool: DistPool) -> None:
    dist_pool.run(_check_split, 2, args=(None, 8.0))


@pytest.mark.parametrize("split", [[3, 5], [7, 1]], ids=["3-5", "7-1"])
def test_uneven_stages_match_one_process(dist_pool: DistPool, split: list[int]) -> None:
    dist_pool.run(_check_split, 2, args=(split, 1.0))


def _empty_first_stage() -> str:
    """A first stage with no layers returns its batch: one sentence, before any exchange."""
    pp_group, rank = _pp_group()
    comm = P2PCommunicator(pp_group, tensor_shape=SHAPE)  # collective: both ranks build it
    if rank == 1:  # the error comes at rank 0's first forward, before it sends anything
        return ""
    batches = _batches(2)
    copies = [x.clone() for x, _ in batches]
    rec = _Recorder(rank_device(), False)
    try:
        get_forward_backward_func(2)(
            forward_step=rec.forward_step,
            data_iterator=iter([(i, x, y) for i, (x, y) in enumerate(batches)]),
            model=nn.Sequential(),
            num_microbatches=2,
            communicator=comm,
        )
    except ValueError as exc:
        assert all(torch.equal(x, c) for (x, _), c in zip(batches, copies, strict=True))
        return str(exc)
    return "no error raised"


def test_a_stage_without_layers_is_one_sentence(dist_pool: DistPool) -> None:
    message = dist_pool.run(_empty_first_stage, 2)[0]
    assert "pipeline stage 0 (chunk 0) returned an output that does not require grad" in message
    assert "give that stage at least one layer with parameters" in message
