"""``DistributedOptimizer(flat_fused=True)`` steps like the wrapped torch Adam(W), keeps its
state in flat buffers viewed by the torch state, and writes the bf16 parameters itself.

Tolerance: on CPU the flat path runs the same elementwise fp32 ops as torch's single-tensor
Adam, on flat views instead of per-parameter tensors; a vectorised loop and a scalar tail may
round one op differently (a fused multiply-add or not), a few ulps of each value or of its
update a step. Over ``STEPS`` steps those add and pass into the next gradients, so we allow
the rounding bound of :func:`assert_close_to_reference` with ``n`` = the rounded ops chained
into one value (``OPS`` a step, forward and backward included, times ``STEPS``) and the
value's own magnitude as the scale. A wrong hyperparameter, a missed bias correction or a
moment of the wrong piece moves values by a fraction of ``lr`` (1e-2), far above it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_zero_optim import DistributedDataParallel, DistributedOptimizer, DynamicLossScaler
from mega_zero_optim.flat_adamw import SegmentStep

WIDTH, BATCH, STEPS, LR = 16, 8, 5, 1e-2
OPS = 4 * WIDTH + 8  # a forward and backward of the 2-layer net, then the optimizer's ops
NUMEL = 2 * (WIDTH * WIDTH + WIDTH) + 2 * WIDTH  # the net's parameters: two linears, a norm


def _net(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)
    )
    return net.to(rank_device()).to(dtype)


def _build(
    flat: bool,
    *,
    kind: str = "AdamW",
    dtype: torch.dtype = torch.float32,
    clip: float | None = None,
    sharding: str = "optimizer",
    grad_dtype: torch.dtype = torch.float32,
    scaler: bool = False,
) -> tuple[DistributedOptimizer, DistributedDataParallel]:
    """Two param groups (weights decayed, biases and the norm not) interleaved in the small
    buckets, so shards hold pieces of both and several launches each."""
    groups = init_process_groups(ParallelConfig())
    ddp = DistributedDataParallel(
        _net(dtype), dp_group=groups.dp, bucket_size=200, sharding=sharding, grad_dtype=grad_dtype
    )
    named = list(ddp.module.named_parameters())
    param_groups = [
        {"params": [p for n, p in named if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for n, p in named if p.dim() == 1], "weight_decay": 0.0},
    ]
    cls = getattr(torch.optim, kind)
    opt = DistributedOptimizer(
        cls(param_groups, lr=LR, eps=1e-6),
        ddp,
        max_grad_norm=clip,
        loss_scaler=DynamicLossScaler(2.0**10) if scaler else None,
        flat_fused=flat,
    )
    return opt, ddp


def _train(
    opt: DistributedOptimizer,
    ddp: DistributedDataParallel,
    steps: range,
    clip: float | None = None,
) -> list[float]:
    """Train over ``steps``; the gradient norm of each step."""
    norms = []
    dp, rank = ddp.dp_size, dist.get_rank(ddp.dp_group)
    per = BATCH // dp
    dtype = next(ddp.module.parameters()).dtype
    for step in steps:
        for group in opt.param_groups:  # as a schedule does: the flat step reads it each time
            group["lr"] = LR / (1 + step)
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, WIDTH, generator=gen)[rank * per : (rank + 1) * per]
        y = torch.randn(BATCH, WIDTH, generator=gen)[rank * per : (rank + 1) * per]
        opt.zero_grad()
        out = ddp(x.to(rank_device(), dtype))
        loss = F.mse_loss(out.float(), y.to(rank_device()))
        opt.scale_loss(loss).backward()
        result = opt.step()
        assert result.updated
        assert clip is None or result.grad_norm > clip, "clipping must be active"
        norms.append(result.grad_norm)
    return norms


def _compare(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """Two state dicts of this rank: master values and every state tensor, per piece."""
    for name, entry in want["params"].items():
        for mine, ref in zip(got["params"][name]["pieces"], entry["pieces"], strict=True):
            assert (mine["start"], mine["end"]) == (ref["start"], ref["end"])
            assert set(mine["state"]) == set(ref["state"]) == {"step", "exp_avg", "exp_avg_sq"}
            for key in ("exp_avg", "exp_avg_sq"):
                value, expected = mine["state"][key], ref["state"][key]
                assert value.dtype == expected.dtype and value.device == expected.device
                assert_close_to_reference(
                    value, expected, reduction_length=OPS * STEPS, name=f"{what} {name} {key}"
                )
            assert float(mine["state"]["step"]) == float(ref["state"]["step"])
            assert mine["state"]["step"].device == ref["state"]["step"].device
            assert_close_to_reference(
                mine["master"], ref["master"], reduction_length=OPS * STEPS, name=f"{what} {name}"
            )


def _low_precision_is_rounded_master(opt: DistributedOptimizer) -> None:
    """Each bf16/fp16 parameter shard the flat step wrote is its masters rounded (read from
    the shards: under ZeRO-3 the module's parameters hold nothing outside a forward)."""
    assert opt._flat is not None
    for shard in opt._flat.shards:
        assert shard.low_precision is not None
        base = shard.master.storage_offset()
        for master in shard.pieces:
            start = master.storage_offset() - base
            written = shard.low_precision[start : start + master.numel()]
            assert torch.equal(written, master.to(written.dtype))


def _flat_equals_torch(options: dict[str, Any]) -> str:
    """Both paths from the same start over the same batches; options of :func:`_build`."""
    states, norms = [], []
    for flat in (True, False):
        opt, ddp = _build(flat, **options)
        norms.append(torch.tensor(_train(opt, ddp, range(STEPS), options.get("clip"))))
        states.append(opt.state_dict())
        if flat and options.get("dtype", torch.float32) != torch.float32:
            _low_precision_is_rounded_master(opt)
    _compare(states[0], states[1], f"flat {options}")
    # the flat step's norm reads bf16/fp16 gradients as they are (no fp32 copies), each
    # square summed in fp32: the gradients carry the states' rounding (OPS * STEPS), then
    # the sum of squares runs over every element (NUMEL), in another order on each path
    assert_close_to_reference(
        norms[0], norms[1], reduction_length=OPS * STEPS + NUMEL, name=f"flat {options} norms"
    )
    return "ok"


SINGLE = {
    "adamw": {"kind": "AdamW"},
    "adamw_clipped": {"kind": "AdamW", "clip": 0.05},
    "adam_l2_clipped": {"kind": "Adam", "clip": 0.05},
    "adamw_bf16": {"kind": "AdamW", "dtype": torch.bfloat16, "clip": 0.05},
    "adam_fp16_scaled_fp16_grads": {
        "kind": "Adam",
        "dtype": torch.float16,
        "grad_dtype": torch.float16,
        "scaler": True,
    },
}


@pytest.mark.parametrize("case", list(SINGLE))
def test_flat_equals_torch(dist_pool: DistPool, case: str) -> None:
    assert dist_pool.run(_flat_equals_torch, 1, args=(SINGLE[case],)) == ["ok"]


@pytest.mark.parametrize("sharding", ["optimizer", "parameters"])
def test_flat_equals_torch_at_dp2(dist_pool: DistPool, sharding: str) -> None:
    options = {"dtype": torch.bfloat16, "clip": 0.05, "sharding": sharding}
    assert dist_pool.run(_flat_equals_torch, 2, args=(options,)) == ["ok", "ok"]


def _flat_views(opt: DistributedOptimizer) -> None:
    """Every piece's moments are views into its shard's flat buffers."""
    flat = opt._flat
    assert flat is not None
    for shard, moments in zip(flat.shards, flat.moments, strict=True):
        assert moments is not None
        for master in shard.pieces:
            state = opt.optimizer.state[master]
            for key, buffer in zip(("exp_avg", "exp_avg_sq"), moments, strict=True):
                lo = buffer.data_ptr()
                hi = lo + buffer.numel() * buffer.element_size()
                assert lo <= state[key].data_ptr() < hi, key
                assert (
                    state[key].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
                )


def _checkpoint_crosses() -> str:
    """A state saved by either path loads into the other, and training goes on as in one
    uninterrupted run of the plain path."""
    half = STEPS // 2 + 1
    ref, ref_ddp = _build(False, dtype=torch.bfloat16)
    _train(ref, ref_ddp, range(STEPS))
    want = ref.state_dict()
    for first, then in ((True, False), (False, True)):
        opt, ddp = _build(first, dtype=torch.bfloat16)
        _train(opt, ddp, range(half))
        saved = opt.state_dict()
        resumed, resumed_ddp = _build(then, dtype=torch.bfloat16)
        resumed.load_state_dict(saved)
        if then:
            _flat_views(resumed)
        _train(resumed, resumed_ddp, range(half, STEPS))
        if then:
            _flat_views(resumed)
            _low_precision_is_rounded_master(resumed)
        _compare(resumed.state_dict(), want, f"saved flat={first}, resumed flat={then}")
    return "ok"


def test_checkpoint_crosses_paths(dist_pool: DistPool) -> None:
    assert dist_pool.run(_checkpoint_crosses, 2) == ["ok", "ok"]


def _segments_are_maximal(opt: DistributedOptimizer) -> int:
    """Launches cover every stepped piece once, each a run of adjacent pieces of one group,
    no two of which could be one; the number of launches."""
    flat = opt._flat
    assert flat is not None and flat._segments is not None
    group_of = {id(m): i for i, g in enumerate(opt.param_groups) for m in g["params"]}
    covered = 0
    for seg, after in zip(flat._segments, [*flat._segments[1:], None], strict=True):
        shard = flat.shards[seg.shard]
        base = shard.master.storage_offset()
        inside = [m for m in shard.pieces if seg.start <= m.storage_offset() - base < seg.end]
        assert sum(m.numel() for m in inside) == seg.end - seg.start, "a gap inside a launch"
        assert {group_of[id(m)] for m in inside} == {seg.group}
        covered += len(inside)
        if after is not None and after.shard == seg.shard and after.start == seg.end:
            assert after.group != seg.group, "two launches could have been one"
    assert covered == sum(len(s.pieces) for s in flat.shards)
    return len(flat._segments)


def _fresh_state_is_lazy_and_views() -> str:
    opt, ddp = _build(True)
    assert not opt.optimizer.state, "no state before the first step, as torch"
    assert opt.state_dict()["params"]["0.weight"]["pieces"][0]["state"] == {}
    _train(opt, ddp, range(1))
    _flat_views(opt)
    pieces = sum(len(s.pieces) for s in opt._flat.shards)  # type: ignore[union-attr]
    launches = _segments_are_maximal(opt)
    assert len(opt._flat.shards) < launches < pieces, (launches, pieces)  # type: ignore[union-attr]
    return "ok"


def test_state_is_created_on_the_first_step(dist_pool: DistPool) -> None:
    assert dist_pool.run(_fresh_state_is_lazy_and_views, 1) == ["ok"]


# the Triton kernel itself, in the interpreter -------------------------------------------------

F32, BF16 = torch.float32, torch.bfloat16
KERNEL_CASES = [  # (numel, grad, low-precision, decoupled, decay, grad_mul, beta1, moments)
    (1, F32, None, True, 0.1, 1.0, 0.9, F32),
    (1000, BF16, BF16, True, 0.1, 0.3, 0.9, F32),
    (4099, F32, BF16, False, 0.1, 1.0, 0.9, F32),
    (777, torch.float16, torch.float16, True, 0.0, 0.5, 0.3, F32),
    (1000, BF16, BF16, True, 0.1, 0.3, 0.9, BF16),
    (4099, F32, BF16, False, 0.1, 1.0, 0.9, BF16),
    (777, torch.float16, torch.float16, True, 0.0, 0.5, 0.3, BF16),
]


def _rounded(master: torch.Tensor, dtype: torch.dtype, kernel: bool) -> torch.Tensor:
    """``master`` rounded to nearest even in ``dtype``, as torch and compiled Triton round;
    but Triton's interpreter (3.9) casts fp32 to bf16 by truncating the low 16 bits."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if kernel and interpreted and dtype == torch.bfloat16:
        return (master.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # exact
    return master.to(dtype)


def _one_step(segment: Any, hp: SegmentStep, kernel: bool) -> None:
    """One step of a ``SegmentTensors``: through the Triton kernel (checked to be the one
    chosen) or the torch ops (imported here, as the cases import them, in their process)."""
    from mega_zero_optim.flat_adamw import _kernel_applies, adamw_segment_torch, step_segment

    if kernel:
        assert _kernel_applies(segment), "the kernel is not chosen"
        step_segment(segment, hp)
    else:
        adamw_segment_torch(segment, hp)


def _kernel_case(index: int) -> None:
    """Three steps of one segment through the kernel and through torch, from one start."""
    from mega_zero_optim.flat_adamw import SegmentTensors

    n, grad_dtype, low_dtype, decoupled, decay, grad_mul, beta1, moments_dtype = KERNEL_CASES[index]
    if moments_dtype != torch.float32:
        _kernel_case_rounded_moments(index)
        return
    gen = torch.Generator().manual_seed(index)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    master = torch.randn(n, generator=gen)
    moments = torch.randn(n, generator=gen) * 0.01, torch.rand(n, generator=gen) * 1e-4
    runs = []
    for kernel in (True, False):
        tensors = [t.clone().to(dev) for t in (master, *moments)]
        low = None if low_dtype is None else torch.empty(n, dtype=low_dtype, device=dev)
        for step in range(1, 4):
            grad = torch.randn(n, generator=torch.Generator().manual_seed(step)).to(dev, grad_dtype)
            hp = SegmentStep(grad_mul, 1e-2 / step, decay, decoupled, beta1, 0.999, 1e-8, step)
            _one_step(SegmentTensors(grad, *tensors, low), hp, kernel)
        if low is not None:
            assert torch.equal(low.cpu(), _rounded(tensors[0].cpu(), low_dtype, kernel))
        runs.append(tensors)
    # each of the ~8 rounded ops of a step may round differently (the kernel and the
    # vectorised CPU loops may contract a*b+c into one fused multiply-add, or not): an ulp of
    # the value each, over 3 chained steps, so n = 3 * 8 at the values' magnitude
    for what, got, want in zip(("master", "exp_avg", "exp_avg_sq"), *runs, strict=True):
        assert_close_to_reference(got, want, reduction_length=3 * 8, name=f"case {index} {what}")


def _kernel_case_rounded_moments(index: int) -> None:
    """bf16 moments: three steps in lockstep, each from the torch run's last state.

    Both update the master from the step's unrounded fp32 moments, to the fp32 bound of one
    step's ~8 ops; then each rounds its moments into bf16, and two fp32 values that close
    round to the same or neighbouring bf16 values (the interpreter truncates: also at most
    one apart), one bf16 unit, at most 2^-7 of the value. Chained steps would carry such a
    unit into the next, so each step starts again from one state."""
    from mega_zero_optim.flat_adamw import SegmentTensors

    n, grad_dtype, low_dtype, decoupled, decay, grad_mul, beta1, moments_dtype = KERNEL_CASES[index]
    gen = torch.Generator().manual_seed(index)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    state = [
        torch.randn(n, generator=gen),
        (torch.randn(n, generator=gen) * 0.01).to(moments_dtype),
        (torch.rand(n, generator=gen) * 1e-4).to(moments_dtype),
    ]
    for step in range(1, 4):
        grad = torch.randn(n, generator=torch.Generator().manual_seed(step)).to(dev, grad_dtype)
        hp = SegmentStep(grad_mul, 1e-2 / step, decay, decoupled, beta1, 0.999, 1e-8, step)
        runs = []
        for kernel in (True, False):
            tensors = [t.clone().to(dev) for t in state]
            low = None if low_dtype is None else torch.empty(n, dtype=low_dtype, device=dev)
            _one_step(SegmentTensors(grad, *tensors, low), hp, kernel)
            assert tensors[1].dtype == tensors[2].dtype == moments_dtype
            if low is not None:
                assert torch.equal(low.cpu(), _rounded(tensors[0].cpu(), low_dtype, kernel))
            runs.append([t.cpu() for t in tensors])
        (master, *moments), (want_master, *want_moments) = runs
        assert_close_to_reference(master, want_master, reduction_length=8, name=f"{index} master")
        for what, got, want in zip(("exp_avg", "exp_avg_sq"), moments, want_moments, strict=True):
            torch.testing.assert_close(
                got.float(), want.float(), rtol=2.0**-7, atol=0.0, msg=f"{index} {what}"
            )
        state = runs[1]


def _kernel_results() -> None:
    """In the child: each case's outcome ("ok" or its traceback), as one JSON line."""
    outcomes = {}
    for index in range(len(KERNEL_CASES)):
        try:
            _kernel_case(index)
            outcomes[index] = "ok"
        except Exception:
            outcomes[index] = traceback.format_exc()
    print(json.dumps(outcomes))


def test_triton_kernel_equals_torch_ops() -> None:
    """In a child process: interpreted on CPU (``TRITON_INTERPRET=1`` must be set before
    triton is first imported, so not in this one), compiled on CUDA."""
    pytest.importorskip("triton")
    interpret = {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}
    child = f"import runpy; runpy.run_path({__file__!r})['_kernel_results']()"
    done = subprocess.run(
        [sys.executable, "-c", child], env={**os.environ, **interpret}, capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcomes == {str(i): "ok" for i in range(len(KERNEL_CASES))}, outcomes


# refusals ------------------------------------------------------------------------------------


def _refusal(case: str) -> str:
    groups = init_process_groups(ParallelConfig())
    dtype = torch.float64 if case == "float64" else torch.float32
    ddp = DistributedDataParallel(_net(dtype), dp_group=groups.dp)
    params = ddp.parameters()
    optimizers = {
        "sgd": lambda: torch.optim.SGD(params, lr=0.1),
        "amsgrad": lambda: torch.optim.AdamW(params, amsgrad=True),
        "maximize": lambda: torch.optim.Adam(params, maximize=True),
    }
    optimizer = optimizers.get(case, lambda: torch.optim.AdamW(params))()
    try:
        DistributedOptimizer(optimizer, ddp, flat_fused=True, optimizer_offload=case == "offload")
    except ValueError as exc:
        return str(exc)
    return "no error"


REFUSALS = {
    "sgd": "flat_fused (True) steps AdamW or Adam in one kernel, but the optimizer is SGD; use "
    "torch.optim.AdamW or Adam, or leave flat_fused False",
    "amsgrad": "flat_fused (True) does not implement amsgrad (param group 0 of the AdamW has "
    "amsgrad=True); set amsgrad=False or leave flat_fused False",
    "maximize": "flat_fused (True) does not implement maximize (param group 0 of the Adam has "
    "maximize=True); set maximize=False or leave flat_fused False",
    "offload": "flat_fused (True) steps the shards on the device, but optimizer_offload is True "
    "(with or without overlap_host_update); leave one of the two False",
    "float64": "flat_fused (True) takes fp32, bf16 or fp16 parameter buffers, but one is "
    "torch.float64; train in one of those or leave flat_fused False",
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusal_is_one_sentence(dist_pool: DistPool, case: str) -> None:
    assert dist_pool.run(_refusal, 1, args=(case,)) == [REFUSALS[case]]


def _nan_named_by_flat_step() -> str:
    """A bf16 run with bf16 gradient buffers (the flat step copies none into fp32): a nan
    in one gradient is named, not taken for an overflowed sum."""
    opt, ddp = _build(True, dtype=torch.bfloat16, grad_dtype=torch.bfloat16)
    opt.zero_grad()
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(0))
    ddp(x.to(rank_device(), torch.bfloat16)).float().square().mean().backward()
    ddp.module[3].weight.main_grad[2, 1] = float("nan")
    with pytest.raises(FloatingPointError) as caught:
        opt.step()
    return str(caught.value)


def test_flat_step_names_a_nan_gradient(dist_pool: DistPool) -> None:
    [message] = dist_pool.run(_nan_named_by_flat_step, 1)
    assert message.startswith("step 1: the gradient of '3.weight' holds nan or inf"), message
