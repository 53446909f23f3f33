"""Delayed FP8 scaling (``Fp8Recipe(amax_history=n)``): scales from earlier steps' amaxes.

What is checked, and why each check is exact:
- A cold step (no history yet) quantises as current scaling does: same fp8 values, same
  results, bit for bit. It records the max ``|x|`` and ``|dy|`` over its micro-batches.
- A warm step quantises the input and the output gradient by the max over the history
  (the weight by its own amax): equal bit for bit to a hand-written quantise-dequantise
  with those amaxes (the emulation's GEMM is the same fp32 product of fp8 values, see
  test_fp8.py). Values beyond a stale amax saturate at the format's largest value.
- Compiled (Dynamo + AOTAutograd, and Inductor on CPU) equals eager, histories included.
- Layouts: every rank records its local maxes and one MAX all-reduce closes the step, so
  tp 2 (with and without sequence parallelism) and dp 2 produce the one-process history
  exactly (a max is exact in any order), and the tp block's outputs and gradients then
  equal the one-process block's within fp32 summation order, as in test_fp8.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_tp_layers import (
    ColumnParallelLinear,
    Fp8AmaxHistory,
    Fp8Recipe,
    Normal,
    RowParallelLinear,
    amax_history_for,
    delayed_for,
    discard_fp8_amaxes,
    fp8_linear,
    init_full,
    param_generator,
    recorded_amax,
    refresh_fp8_amax_histories,
    set_fp8_amax_recording,
    set_fp8_grad_unit,
    shard_tensor,
    update_fp8_amax_histories,
)
from mega_tp_layers.fp8_delayed import opaque_amax
from mega_tp_layers.fp8_scaling import check_fp8_layout

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CURRENT = Fp8Recipe(emulate=True)
DELAYED = Fp8Recipe(emulate=True, amax_history=2)
SEED = 7
S, B, H, FFN = 8, 2, 32, 64  # every GEMM dim a multiple of 16 at tp 1 and 2, SP included
# the block's longest chain of fp32 sums (fc1 and fc2 forward and back, then a wgrad's tokens)
N_BLOCK = 2 * (H + FFN) + S * B


def _randn(*shape: int, seed: int, scale: float = 1.0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _push(history: Fp8AmaxHistory, amax: Tensor) -> None:
    """One finished step of ``history`` alone: its running maxes set to ``amax``, then the
    step's update."""
    history.current.copy_(amax)
    update_fp8_amax_histories([history], None)


class _Linear(nn.Module):
    """``fp8_linear`` with an amax history, as the layers wire it."""

    def __init__(self, recipe: Fp8Recipe, weight: Tensor) -> None:
        super().__init__()
        self.recipe, self.weight = recipe, nn.Parameter(weight.clone())
        self.fp8_amax = amax_history_for(recipe, None)

    def forward(self, x: Tensor) -> Tensor:
        delayed = delayed_for(self.fp8_amax, x)
        return fp8_linear(x, self.weight, recipe=self.recipe, delayed=delayed)


def _hand_q(t: Tensor, amax: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Quantise by hand with a given amax (saturating): fp8 values widened, inverse scale."""
    fmax = torch.finfo(dtype).max
    scale = fmax / amax.clamp(min=1e-12)
    return (t * scale).clamp(-fmax, fmax).to(dtype).float(), scale.reciprocal()


def _step(layer: nn.Module, xs: list[Tensor], dys: list[Tensor]) -> list[Tensor]:
    outs = []
    for x, dy in zip(xs, dys, strict=True):
        y = layer(x)
        y.backward(dy)
        outs.append(y.detach())
    return outs


def test_cold_step_is_current_scaling_and_records_the_step_max() -> None:
    w = _randn(FFN, H, seed=1)
    xs = [_randn(16, H, seed=2), _randn(16, H, seed=3, scale=3.0)]
    dys = [_randn(16, FFN, seed=4, scale=1e-3), _randn(16, FFN, seed=5, scale=2e-3)]
    current, delayed = _Linear(CURRENT, w), _Linear(DELAYED, w)
    for got, want in zip(_step(delayed, xs, dys), _step(current, xs, dys), strict=True):
        assert torch.equal(got, want)
    assert delayed.weight.grad is not None and current.weight.grad is not None
    assert torch.equal(delayed.weight.grad, current.weight.grad)
    history = delayed.fp8_amax
    assert history is not None and not history.warm
    expect = torch.stack([torch.stack(xs).abs().amax(), torch.stack(dys).abs().amax()])
    assert torch.equal(history.current, expect)  # the max over both micro-batches
    assert history.probe.grad is None  # folded into current, not summed by AccumulateGrad
    assert update_fp8_amax_histories([delayed], None) == 1
    assert history.warm and torch.equal(history.history[0], expect)
    assert not bool(history.current.any()) and not bool(history.history[1].any())


def test_warm_step_scales_by_the_history_max_exactly() -> None:
    w = _randn(FFN, H, seed=6)
    layer = _Linear(DELAYED, w)
    history = layer.fp8_amax
    assert history is not None
    amaxes = [(4.0, 1e-2), (1.5, 3e-3), (2.5, 2e-3)]  # step by step: (|x| max, |dy| max)
    for ax, ag in amaxes:
        _push(history, torch.tensor([ax, ag]))
    # the last 2 steps count: 2.5 for the input, 3e-3 for the gradient
    ax, ag = torch.tensor(2.5), torch.tensor(3e-3)
    x = _randn(16, H, seed=7)
    x[0, 0] = 9.0  # beyond the history's amax: saturates at e4m3's largest value
    dy = _randn(16, FFN, seed=8, scale=1e-3)
    xp = x.clone().requires_grad_()
    y = layer(xp)
    y.backward(dy)
    (qx, ix), (qg, ig) = _hand_q(x, ax, E4M3), _hand_q(dy, ag, E5M2)
    qw, iw = _hand_q(w, w.abs().amax(), E4M3)  # the weight: current scaling
    assert float(qx[0, 0]) == torch.finfo(E4M3).max  # saturated, not inf
    assert torch.equal(y, (qx @ qw.t()) * (ix * iw))
    assert xp.grad is not None and layer.weight.grad is not None
    assert torch.equal(xp.grad, (qg @ qw) * (ig * iw))
    assert torch.equal(layer.weight.grad, (qg.t() @ qx) * (ig * ix))
    want = torch.stack([x.abs().amax(), dy.abs().amax()])
    assert torch.equal(history.current, want)  # this step's own maxes, for the next one


def test_margin_scales_by_a_larger_amax_exactly() -> None:
    """amax_margin m: the history's amax times 2^m (exact), so a value up to 2^m x beyond the
    history's max is represented instead of saturating."""
    recipe = Fp8Recipe(emulate=True, amax_history=2, amax_margin=2)
    w = _randn(FFN, H, seed=26)
    layer = _Linear(recipe, w)
    assert layer.fp8_amax is not None and layer.fp8_amax.margin == 2
    _push(layer.fp8_amax, torch.tensor([2.5, 3e-3]))
    x = _randn(16, H, seed=27)
    x[0, 0] = 9.0  # beyond 2.5, within 2.5 x 4: not saturated
    dy = _randn(16, FFN, seed=28, scale=1e-3)
    xp = x.clone().requires_grad_()
    y = layer(xp)
    y.backward(dy)
    ax, ag = torch.tensor(2.5 * 4), torch.tensor(3e-3) * 4  # the history's amaxes x 2^2
    (qx, ix), (qg, ig) = _hand_q(x, ax, E4M3), _hand_q(dy, ag, E5M2)
    qw, iw = _hand_q(w, w.abs().amax(), E4M3)
    assert float(qx[0, 0]) == 416.0  # 9 x 448 / 10 = 403.2 rounds to 416, below e4m3's 448
    assert torch.equal(y, (qx @ qw.t()) * (ix * iw))
    assert xp.grad is not None and torch.equal(xp.grad, (qg @ qw) * (ig * iw))


def test_overshoot_is_the_largest_growth_over_the_used_amax() -> None:
    """The step's amax over the amax its scales used (history max x 2^margin), the largest
    over warm layers, maxed into the caller's tensor across steps; a cold layer counts 0."""
    a, b, cold = Fp8AmaxHistory(2), Fp8AmaxHistory(3, margin=1), Fp8AmaxHistory(2)
    for history, first in ((a, [2.0, 1e-2]), (b, [1.0, 4e-3])):
        _push(history, torch.tensor(first))
    a.current.copy_(torch.tensor([3.0, 5e-3]))  # input 1.5x its history, gradient 0.5x
    b.current.copy_(torch.tensor([1.0, 1.2e-2]))  # input 0.5x of 2x1.0, gradient 1.5x of 2x4e-3
    cold.current.copy_(torch.tensor([100.0, 1.0]))
    overshoot = torch.zeros(2)
    update_fp8_amax_histories([a, b, cold], None, overshoot=overshoot)
    torch.testing.assert_close(overshoot, torch.tensor([1.5, 1.5]), rtol=2**-20, atol=0)
    a.current.copy_(torch.tensor([1.0, 1e-2]))  # 1.0 / max(3, 2) and 1e-2 / max(5e-3, 1e-2)
    update_fp8_amax_histories([a], None, overshoot=overshoot)
    torch.testing.assert_close(overshoot, torch.tensor([1.5, 1.5]), rtol=2**-20, atol=0)
    fresh = torch.zeros(2)
    b.current.copy_(torch.tensor([8.0, 0.0]))  # 8 / (2 x max(1, 1)): 4x
    update_fp8_amax_histories([b], None, overshoot=fresh)
    torch.testing.assert_close(fresh, torch.tensor([4.0, 0.0]), rtol=2**-20, atol=0)


def test_a_step_that_records_nothing_scales_from_the_history() -> None:
    """amax_interval 2: on a step that does not record, the casts scale from the history
    exactly as a recording step would, and neither |x| nor |dy| is reduced: the running
    maxes stay zero, the probe gets no gradient, the update pushes nothing."""
    recipe = Fp8Recipe(emulate=True, amax_history=2, amax_interval=2)
    w = _randn(FFN, H, seed=36)
    layer = _Linear(recipe, w)
    history = layer.fp8_amax
    assert history is not None and history.interval == 2
    _push(history, torch.tensor([2.5, 3e-3]))
    before = history.history.clone()
    assert not set_fp8_amax_recording([layer], 1)  # step 1 of interval 2: no recording
    x, dy = _randn(16, H, seed=37), _randn(16, FFN, seed=38, scale=1e-3)
    xp = x.clone().requires_grad_()
    y = layer(xp)
    y.backward(dy)
    (qx, ix), (qg, ig) = _hand_q(x, torch.tensor(2.5), E4M3), _hand_q(dy, torch.tensor(3e-3), E5M2)
    qw, iw = _hand_q(w, w.abs().amax(), E4M3)
    assert torch.equal(y, (qx @ qw.t()) * (ix * iw))
    assert xp.grad is not None and torch.equal(xp.grad, (qg @ qw) * (ig * iw))
    assert not history.current.any() and history.probe.grad is None
    assert update_fp8_amax_histories([layer], None) == 0
    assert torch.equal(history.history, before)
    assert set_fp8_amax_recording([layer], 2)  # step 2: records again
    layer(x).backward(dy)
    assert torch.equal(history.current, torch.stack([x.abs().amax(), dy.abs().amax()]))


def test_recording_steps_follow_each_interval() -> None:
    """Step k records where k % interval == 0; a cold history records on any step."""
    every, second, third = (Fp8AmaxHistory(2, interval=i) for i in (1, 2, 3))
    for h in (every, second, third):
        h.warm = True
    seen = []
    for step in range(6):
        set_fp8_amax_recording([every, second, third], step)
        seen.append((every.recording, second.recording, third.recording))
    assert [s[1] for s in seen] == [True, False] * 3 and [s[2] for s in seen] == [
        True,
        False,
        False,
    ] * 2
    assert all(s[0] for s in seen)
    cold = Fp8AmaxHistory(2, interval=4)
    assert set_fp8_amax_recording([cold], 3) and not cold.recording  # cold: records anyway
    assert cold.for_forward(torch.ones(2)).probe is cold.probe


def test_history_keeps_the_last_n_steps() -> None:
    history = Fp8AmaxHistory(2)
    _push(history, torch.tensor([4.0, 1.0]))
    _push(history, torch.tensor([1.0, 3.0]))
    assert torch.equal(history.history.amax(0), torch.tensor([4.0, 3.0]))
    _push(history, torch.tensor([2.0, 0.5]))  # the first step drops out
    assert torch.equal(history.history.amax(0), torch.tensor([2.0, 3.0]))


@pytest.mark.parametrize("shape", [(), (5,), (7, 3), (4, 2, 9)], ids=["0d", "1d", "2d", "3d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recorded_amax_is_the_whole_tensor_max(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """The fusable rows-first form and the opaque operator: both the value of one max over
    every element (a max rounds nothing), as a 0-d fp32 tensor, with no gradient; and the
    operator's fake (meta) result has that shape and dtype for the compiler."""
    x = _randn(*(shape or (1,)), seed=11, scale=3.0).reshape(shape).to(dtype).requires_grad_()
    x[(0,) * len(shape)].detach().fill_(
        -20.0
    )  # the largest magnitude (randn x 3 stays below), negative
    for amax in (recorded_amax, opaque_amax):
        got = amax(x)
        assert got.dtype == torch.float32 and got.dim() == 0 and not got.requires_grad
        assert torch.equal(got, x.detach().abs().amax().float()) and float(got) == 20.0
    fake = opaque_amax(torch.empty(shape, dtype=dtype, device="meta"))
    assert fake.shape == () and fake.dtype == torch.float32


def test_grad_unit_keeps_one_process_units() -> None:
    """A rank whose output gradients are 4x one process's stores a quarter of its |dy| max
    and scales by 4x the stored one: the history reads as one process's at any layout."""
    history = Fp8AmaxHistory(2)
    set_fp8_grad_unit([history], 4)
    history.current.copy_(torch.tensor([3.0, 8.0]))  # this rank's maxes: |x| 3, |dy| 8
    update_fp8_amax_histories([history], None)
    assert torch.equal(history.history[0], torch.tensor([3.0, 2.0]))
    scales = history.for_forward(torch.ones(1)).amax
    assert scales is not None and torch.equal(scales, torch.tensor([3.0, 8.0]))
    assert "grad_unit=4.0" in repr(history)


def test_update_pushes_histories_of_several_lengths_and_units() -> None:
    """The batched update: each history gets its own row, whatever its length and unit."""
    a, b, c = Fp8AmaxHistory(2), Fp8AmaxHistory(3), Fp8AmaxHistory(2)
    set_fp8_grad_unit([b], 2)
    for step in range(3):
        for i, h in enumerate((a, b, c)):
            h.current.copy_(torch.tensor([1.0 + step + 10 * i, 4.0 * (step + 1)]))
        assert update_fp8_amax_histories([a, b, c], None) == 3
        assert not any(bool(h.current.any()) for h in (a, b, c))
    for i, h in enumerate((a, b, c)):
        unit = 2.0 if h is b else 1.0
        want = [[3.0 - k + 10 * i, 4.0 * (3 - k) / unit] for k in range(h.length)]
        assert torch.equal(h.history, torch.tensor(want)), (i, h.history)


class _CountOps(TorchDispatchMode):
    """Counts the operators called at the top level (a foreach op once, as on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


def _update_ops(layers: int) -> list[str]:
    histories = [Fp8AmaxHistory(4) for _ in range(layers)]
    for h in histories:
        h.current.fill_(1.0)
    with _CountOps() as mode:
        update_fp8_amax_histories(histories, None)
    return mode.calls


def test_update_costs_the_same_ops_for_any_number_of_layers() -> None:
    """A step's update is batched: ten times the layers, the same operator calls (on a GPU,
    the same few kernel launches), not a few per layer."""
    assert _update_ops(40) == _update_ops(4)


def test_skipped_step_and_resume() -> None:
    history = Fp8AmaxHistory(3)
    _push(history, torch.tensor([2.0, 1.0]))
    history.current.copy_(torch.tensor([float("inf"), 5.0]))  # a step with non-finite values
    discard_fp8_amaxes([history])
    assert not bool(history.current.any()) and torch.equal(
        history.history[0], torch.tensor([2.0, 1.0])
    )
    loaded = Fp8AmaxHistory(3)
    loaded.load_state_dict(history.state_dict())  # the history is persistent, current is not
    assert set(history.state_dict()) == {"history"} and not loaded.warm
    refresh_fp8_amax_histories([loaded])
    assert loaded.warm and torch.equal(loaded.history, history.history)
    refresh_fp8_amax_histories([Fp8AmaxHistory(3)])  # an empty history stays cold


def test_materialised_from_meta_is_zero_fp32_with_a_live_probe() -> None:
    history = Fp8AmaxHistory(4, device="meta")
    history.to_empty(device="cpu")
    assert history.history.device.type == "cpu" and not bool(history.history.any())
    history.to(torch.bfloat16)  # a model cast to bf16 keeps its amaxes in fp32
    assert history.history.dtype == history.current.dtype == torch.float32
    assert history.probe.device.type == "cpu" and history.probe.requires_grad
    layer = _Linear(DELAYED, _randn(FFN, H, seed=9))
    layer.fp8_amax = history
    layer(_randn(16, H, seed=10)).sum().backward()
    assert float(history.current[1]) == 1.0 and history.probe.grad is None  # the hook ran
    clone = copy.deepcopy(layer)  # copies keep working (their own probe and hook)
    assert clone.fp8_amax is not None
    clone.fp8_amax.current.zero_()
    clone(_randn(16, H, seed=11)).sum().backward()
    assert float(clone.fp8_amax.current[1]) == 1.0


def test_eval_and_no_grad_forwards_record_nothing() -> None:
    layer = _Linear(DELAYED, _randn(FFN, H, seed=12))
    with torch.no_grad():
        layer(_randn(16, H, seed=13))
    layer.eval()
    layer(_randn(16, H, seed=14))
    assert layer.fp8_amax is not None and not bool(layer.fp8_amax.current.any())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager_over_a_cold_and_warm_steps(backend: str) -> None:
    """The warm flag recompiles once; the buffer write and the probe's gradient survive
    compilation (Inductor on CPU here; on the GPU see bench/RESULTS.md)."""
    w = _randn(FFN, H, seed=15)
    eager, compiled_layer = _Linear(DELAYED, w), _Linear(DELAYED, w)
    compiled = torch.compile(compiled_layer, backend=backend, fullgraph=True)
    try:
        for step in range(3):
            xs = [_randn(16, H, seed=20 + 2 * step + i, scale=1.0 + step) for i in range(2)]
            dys = [_randn(16, FFN, seed=40 + 2 * step + i, scale=1e-3) for i in range(2)]
            want = _step(eager, xs, dys)
            got = _step(compiled, xs, dys)  # type: ignore[arg-type]
            for g, e in zip(got, want, strict=True):
                torch.testing.assert_close(g, e, rtol=2**-20, atol=0)
            assert eager.fp8_amax is not None and compiled_layer.fp8_amax is not None
            assert torch.equal(compiled_layer.fp8_amax.current, eager.fp8_amax.current)
            update_fp8_amax_histories([eager], None)
            update_fp8_amax_histories([compiled_layer], None)
        assert eager.weight.grad is not None and compiled_layer.weight.grad is not None
        torch.testing.assert_close(
            compiled_layer.weight.grad, eager.weight.grad, rtol=2**-20, atol=0
        )
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager_with_an_interval(backend: str) -> None:
    """amax_interval 2: the recording flag gives a variant without reductions; compiled
    steps that record and steps that do not equal eager's, histories included."""
    recipe = Fp8Recipe(emulate=True, amax_history=2, amax_interval=2)
    w = _randn(FFN, H, seed=45)
    eager, compiled_layer = _Linear(recipe, w), _Linear(recipe, w)
    compiled = torch.compile(compiled_layer, backend=backend, fullgraph=True)
    try:
        for step in range(4):
            set_fp8_amax_recording([eager, compiled_layer], step)
            xs = [_randn(16, H, seed=50 + 2 * step + i, scale=1.0 + step) for i in range(2)]
            dys = [_randn(16, FFN, seed=70 + 2 * step + i, scale=1e-3) for i in range(2)]
            want = _step(eager, xs, dys)
            got = _step(compiled, xs, dys)  # type: ignore[arg-type]
            for g, e in zip(got, want, strict=True):
                torch.testing.assert_close(g, e, rtol=2**-20, atol=0)
            update_fp8_amax_histories([eager], None)
            update_fp8_amax_histories([compiled_layer], None)
            assert eager.fp8_amax is not None and compiled_layer.fp8_amax is not None
            assert torch.equal(compiled_layer.fp8_amax.history, eager.fp8_amax.history)
        assert eager.fp8_amax is not None and (eager.fp8_amax.history > 0).all()  # 2 recorded
    finally:
        torch._dynamo.reset()


# ---- layouts: tp 2 (with and without SP) and dp 2 against one process --------------------


def _full(shape: tuple[int, ...], name: str) -> Tensor:
    return init_full(shape, Normal(0.3), param_generator(SEED, name))


def _block_data(step: int, micro: int) -> tuple[Tensor, Tensor]:
    seed = 100 + 10 * step + micro
    return _randn(S, B, H, seed=seed, scale=1.0 + step), _randn(S, B, H, seed=seed + 5, scale=1e-2)


def _one_process_block(steps: int, micro: int) -> tuple[list[Tensor], list[Tensor]]:
    """Histories (fc1, fc2) and the last step's fc1 weight gradient, one process."""
    fc1 = _Linear(DELAYED, _full((FFN, H), "fc1.weight"))
    fc2 = _Linear(DELAYED, _full((H, FFN), "fc2.weight"))
    grads = []
    for step in range(steps):
        fc1.weight.grad = fc2.weight.grad = None
        for m in range(micro):
            x, dy = _block_data(step, m)
            fc2(F.gelu(fc1(x))).backward(dy)
        update_fp8_amax_histories([fc1, fc2], None)
        assert fc1.weight.grad is not None and fc2.weight.grad is not None
        grads = [fc1.weight.grad.clone(), fc2.weight.grad.clone()]
    histories = [m.fp8_amax.history.clone() for m in (fc1, fc2) if m.fp8_amax is not None]
    return histories, grads


def _check_layout(tp: int, sp: bool, dp: int) -> None:
    groups = init_process_groups(ParallelConfig(tp=tp))
    dev = rank_device()
    steps, micro = 3, 2
    ref_hist, ref_grads = _one_process_block(steps, micro)
    common: dict[str, Any] = {"tp_group": groups.tp, "sequence_parallel": sp, "bias": False,
                              "init_method": Normal(0.3), "seed": SEED, "device": dev,
                              "fp8": DELAYED}  # fmt: skip
    fc1 = ColumnParallelLinear(H, FFN, name="fc1", **common)
    fc2 = RowParallelLinear(FFN, H, name="fc2", **common)
    rank, dp_rank = groups.rank("tp"), groups.rank("dp")
    for step in range(steps):
        fc1.weight.grad = fc2.weight.grad = None
        for m in range(micro):
            if m % dp != dp_rank:  # dp: the micro-batches split over the ranks
                continue
            x, dy = _block_data(step, m)
            if sp:
                x, dy = shard_tensor(x, 0, rank, tp), shard_tensor(dy, 0, rank, tp)
            fc2(F.gelu(fc1(x.to(dev)))).backward(dy.to(dev))
        update_fp8_amax_histories([fc1, fc2], groups.tp_dp_cp)
    for layer, want in zip((fc1, fc2), ref_hist, strict=True):
        assert layer.fp8_amax is not None
        assert torch.equal(layer.fp8_amax.history.cpu(), want), (tp, sp, dp)
    if dp == 1:  # the last step's gradients: warm scales, the whole batch on each rank
        assert fc1.weight.grad is not None and fc2.weight.grad is not None
        for got, want, dim in (
            (fc1.weight.grad, ref_grads[0], 0),
            (fc2.weight.grad, ref_grads[1], 1),
        ):
            assert_close_to_reference(
                got.cpu(), shard_tensor(want, dim, rank, tp), reduction_length=N_BLOCK,
                name=f"weight grad tp{tp}{' sp' if sp else ''}",
            )  # fmt: skip
    if tp > 1:  # each rank's local max differs: the all-reduce is what makes them one
        local = torch.tensor([float(fc1.weight.detach().abs().amax())])
        gathered = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(gathered, local, group=groups.tp)
        assert len({float(g) for g in gathered}) == tp


LAYOUTS = [(2, False, 1), (2, True, 1), (1, False, 2)]


@pytest.mark.parametrize(
    ("tp", "sp", "dp"), LAYOUTS, ids=[f"tp{t}{'-sp' if s else ''}-dp{d}" for t, s, d in LAYOUTS]
)
def test_layouts_record_the_one_process_history(
    dist_pool: DistPool, tp: int, sp: bool, dp: int
) -> None:
    dist_pool.run(_check_layout, tp * dp, args=(tp, sp, dp))


# ---- bad input: one sentence naming the values and the way out ----------------------------


@pytest.mark.parametrize(
    ("build", "pattern"),
    [
        (lambda: Fp8Recipe(amax_history=-1), r"amax_history \(-1\) must be a non-negative integer"),
        (lambda: Fp8Recipe(amax_history=True), r"amax_history \(True\) must be a non-negative"),
        (lambda: Fp8Recipe(scaling="row", amax_history=4), r"tensor-wise only, not scaling='row'"),
        (lambda: Fp8AmaxHistory(0), r"Fp8AmaxHistory length \(0\) must be a positive integer"),
        (
            lambda: Fp8Recipe(amax_history=2, amax_margin=-1),
            r"^Fp8Recipe.amax_margin \(-1\) must be an integer from 0 to 8",
        ),
        (
            lambda: Fp8Recipe(amax_margin=1),
            r"^Fp8Recipe\(amax_margin=1\) gives delayed scaling headroom, but amax_history is 0",
        ),
        (lambda: Fp8AmaxHistory(2, margin=9), r"^Fp8AmaxHistory margin \(9\) must be an integer"),
        (
            lambda: Fp8Recipe(amax_history=2, amax_interval=0),
            r"^Fp8Recipe.amax_interval \(0\) must be a positive integer: amaxes are recorded",
        ),
        (
            lambda: Fp8Recipe(amax_interval=4),
            r"^Fp8Recipe\(amax_interval=4\) spaces delayed scaling's recording, but amax_history",
        ),
        (lambda: Fp8AmaxHistory(2, interval=0), r"^Fp8AmaxHistory interval \(0\) must be a "),
        (
            lambda: set_fp8_grad_unit([Fp8AmaxHistory(2)], 0),
            r"set_fp8_grad_unit: unit \(0\) must be a positive number",
        ),
        (
            lambda: fp8_linear(torch.ones(16, 16), torch.ones(16, 16), recipe=DELAYED),
            r"fp8_linear with Fp8Recipe\(amax_history=2\) needs the layer's amax history",
        ),
        (
            lambda: fp8_linear(
                torch.ones(16, 16),
                torch.ones(16, 16),
                recipe=CURRENT,
                delayed=Fp8AmaxHistory(2).for_forward(torch.ones(1)),
            ),
            r"got delayed=\.\.\. but its recipe scales by the current amax",
        ),
        (
            lambda: check_fp8_layout("ColumnParallelLinear", DELAYED, 2, ("out/tp", 32), True),
            r"tp_comm_overlap=True scales by the current amax only, not "
            r"Fp8Recipe\(amax_history=2\)",
        ),
    ],
    ids=[
        "negative",
        "bool",
        "row",
        "zero-length",
        "margin-negative",
        "margin-without-history",
        "margin-too-large",
        "interval-zero",
        "interval-without-history",
        "history-interval-zero",
        "grad-unit",
        "no-history",
        "history-without-recipe",
        "overlap",
    ],
)
def test_bad_input_raises_one_sentence(build: Any, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern) as info:
        build()
    message = str(info.value)
    assert "\n" not in message, message
