"""DualPipeV's overlapped pairs: one unit in the timed plans, one compute step in the executor.

Pure: with the pairs of :func:`~mega_pipeline.dualpipev_pairs` each one unit, the timed
plans run exactly the pure order, each pair's B directly after its F with no exchange of
its own, a unit's two messages over one link split into exchanges that both neighbours
order alike, and replay without deadlock under :func:`~mega_pipeline.simulate_plans`.

With gloo at p 2, m 4 and 8: chunks offering :class:`~mega_pipeline.OverlappedForwardBackward`
get one hook call per pair and none for the other passes; every paired backward runs
inside it; losses and gradients equal plain gradient accumulation (the blocks of
``test_v_schedules``), with the split and with the fused backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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
    OverlappedForwardBackward,
    P2PCommunicator,
    StageChunk,
    broadcast_losses,
    build_timed_plans,
    dualpipev_order,
    dualpipev_pairs,
    forward_backward_dualpipev,
    simulate_plans,
    zbv_stage,
)

CASES = [(p, m) for p in (2, 3, 4) for m in (2 * p, 2 * p + 1, 4 * p)]
H = 8
SHAPE = (2, 3, H)  # [s, b, h]


def _orders(pp: int, m: int, fused: bool) -> tuple[list[list[Action]], list[set[Action]]]:
    orders, pairs = [], []
    for r in range(pp):
        order = dualpipev_order(pp, r, m)
        pairs.append({order[i] for i in dualpipev_pairs(pp, r, m)})
        orders.append([a for a in order if a.kind != "W"] if fused else order)
    return orders, pairs


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(("pp", "m"), CASES)
def test_pairs_are_one_step_and_never_deadlock(pp: int, m: int, fused: bool) -> None:
    orders, pairs = _orders(pp, m, fused)
    plans = build_timed_plans(orders, 2, v_shape=True, pairs=pairs)
    doubled = 0
    for rank, plan in enumerate(plans):
        actions = [s.action for s in plan if s.action is not None]
        assert actions == orders[rank]  # the pure order, nothing else
        for i, step in enumerate(plan):
            if step.action in pairs[rank]:  # its B next, with no exchange in between
                b = plan[i + 1]
                assert b.action == orders[rank][orders[rank].index(step.action) + 1]
                assert b.action is not None and b.action.kind == "B" and b.exchange.is_empty()
            doubled += step.action is None and not step.exchange.is_empty() and i + 1 < len(plan)
    assert doubled > 0  # some unit moves two messages over a link, in two exchanges
    simulate_plans(plans, forward_time=1, backward_time=1, weight_time=1)  # raises on deadlock
    simulate_plans(plans)  # B twice as long as F or W: still no deadlock


def test_a_pair_that_is_not_f_then_b_is_refused() -> None:
    order = dualpipev_order(2, 0, 4)
    with pytest.raises(ValueError, match="is not an F directly followed by a B"):
        build_timed_plans(
            [order, dualpipev_order(2, 1, 4)], 2, v_shape=True, pairs=[{order[0]}, set()]
        )


class _Block(nn.Module):
    """``x + tanh((g x) W^T)``: the linear's W comes in the W pass, the gain's in B."""

    def __init__(self, tp_group: ProcessGroup, index: int) -> None:
        from mega_tp_layers import ColumnParallelLinear, Normal

        super().__init__()
        self.gain = nn.Parameter(torch.ones(H))
        self.fc = ColumnParallelLinear(
            H, H, tp_group=tp_group, init_method=Normal(0.5), seed=7, name=f"b{index}.fc"
        )

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.fc(self.gain * x))


class _Hooked(_Block):
    """A block offering the hook: the forward first, then the other micro-batch's backward
    (the order inside is the chunk's business); it counts its calls."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.calls = 0
        self.records = 0
        self.inside = False

    @contextlib.contextmanager
    def overlap_record(self) -> Iterator[dict[str, int]]:
        self.records += 1
        yield {"made_by": id(self)}

    def overlapped_forward_backward(
        self, forward: Callable[[], Any], record: Any, outputs: Tensor, grads: Tensor | None
    ) -> Any:
        assert "made_by" in record
        self.calls += 1
        self.inside = True
        try:
            result = forward()
            torch.autograd.backward(outputs, grads)
        finally:
            self.inside = False
        return result


def _logging_forward_step(
    chunks: list[_Hooked], backwards: list[tuple[int, int, bool]]
) -> Callable[[Iterator[Any] | None, StageChunk], tuple[Tensor, LossFunc]]:
    """Logs each backward as (microbatch, chunk, whether a hook call was running)."""

    def forward_step(it: Iterator[Any] | None, view: StageChunk) -> tuple[Tensor, LossFunc]:
        assert it is not None
        mb, x, y = next(it)
        out = view(x)
        key = (mb, view.chunk)
        out.register_hook(lambda g: backwards.append((*key, any(c.inside for c in chunks))) or None)
        return out, lambda o: F.mse_loss(o, y)

    return forward_step


def _check_hook(split: bool) -> None:
    from mega_tp_layers import defer_weight_grads

    pp_group = dist.new_group(list(range(dist.get_world_size())))
    tp_group = None
    for r in range(dist.get_world_size()):  # each rank alone as its tp group
        group = dist.new_group([r])
        tp_group = group if r == dist.get_rank() else tp_group
    assert isinstance(pp_group, ProcessGroup) and isinstance(tp_group, ProcessGroup)
    pp, rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    comm = P2PCommunicator(pp_group, tensor_shape=SHAPE, dtype=torch.float32)
    stages = [zbv_stage(pp, rank, c) for c in (0, 1)]
    chunks = [_Hooked(tp_group, s) for s in stages]
    assert all(isinstance(c, OverlappedForwardBackward) for c in chunks)
    for m in (2 * pp, 4 * pp):
        gen = torch.Generator().manual_seed(m)
        batches = [(torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen))
                   for _ in range(m)]  # fmt: skip
        ref = nn.Sequential(*[_Block(tp_group, i) for i in range(2 * pp)])
        ref_losses = []
        for x, y in batches:
            loss = F.mse_loss(ref(x), y)
            (loss / m).backward()
            ref_losses.append(loss.detach())
        for c in chunks:
            c.zero_grad(set_to_none=True)
            c.calls = c.records = 0
        backwards: list[tuple[int, int, bool]] = []  # (mb, chunk, inside a hook call)
        forward_step = _logging_forward_step(chunks, backwards)

        items = [(i, x, y) for i, (x, y) in enumerate(batches)]
        losses = forward_backward_dualpipev(
            forward_step=forward_step,
            data_iterator=[iter(items), iter(items)],
            model=chunks,
            num_microbatches=m,
            communicator=comm,
            split_backward=defer_weight_grads if split else None,
        )
        order = dualpipev_order(pp, rank, m)
        pairs = [(order[i], order[i + 1]) for i in dualpipev_pairs(pp, rank, m)]
        assert sum(c.calls for c in chunks) == len(pairs)  # once per pair, never otherwise
        for c in (0, 1):  # the hook of the pair's forward chunk
            assert chunks[c].calls == sum(f.chunk == c for f, _ in pairs)
        assert sum(c.records for c in chunks) == len(pairs)  # one record per paired B
        paired = {(b.microbatch, b.chunk) for _, b in pairs}
        assert sorted(backwards) == sorted((mb, c, (mb, c) in paired) for mb, c, _ in backwards)
        assert len(backwards) == 2 * m
        shared = torch.stack([d["loss"] for d in broadcast_losses(losses, pp_group, src=0)])
        n = 2 * 2 * pp * H + m * SHAPE[0] * SHAPE[1]  # the GEMM chain, then the tokens
        assert_close_to_reference(shared, torch.stack(ref_losses), reduction_length=n, name="loss")
        ref_params = dict(ref.named_parameters())
        for c, s in zip(chunks, stages, strict=True):
            for pname, p in c.named_parameters():
                expected = ref_params[f"{s}.{pname}"].grad
                assert p.grad is not None and expected is not None, pname
                assert_close_to_reference(p.grad, expected, reduction_length=n, name=pname)


@pytest.mark.parametrize("split", [True, False])
def test_the_hook_runs_each_pair_once(dist_pool: DistPool, split: bool) -> None:
    dist_pool.run(_check_hook, 2, args=(split,))
