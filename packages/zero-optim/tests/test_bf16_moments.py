"""``DistributedOptimizer(moment_dtype=torch.bfloat16)``: Adam's moments stored in bf16.

What is exact, and why. A step with bf16 moments is torch's single-tensor Adam(W) in fp32
whose two moments are then rounded to nearest bf16 (the master's update reads the step's
unrounded moments). On the torch-ops path the flat step runs torch's own ops in torch's
order, on a tensor of the reference's length, so each element goes through the same
instructions: against torch's Adam with its moments rounded after each step it is equal
bit for bit. (On CUDA the Triton kernel steps instead; ``test_flat_adamw`` compares it with
these ops.)

ZeRO-1 at dp 2 against dp 1: every rank trains on the same batch, so each rank's gradient
is bitwise the one process's and their dp mean ((g + g) / 2) is g exactly; every shard and
run of pieces is a multiple of 64 elements, so no element falls in a SIMD loop's scalar
tail (where a kernel set may contract a multiply-add differently from the vector body) at
either dp. The weights after the steps are equal bit for bit. (Distinct batches per rank
are the fp32 contract tests' subject; with bf16 moments their reordered sums may move a
moment across a bf16 rounding boundary, a 2^-8 relative step no tight bound explains.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_zero_optim import DistributedDataParallel, DistributedOptimizer
from mega_zero_optim.flat_adamw import SegmentStep, SegmentTensors, step_segment

BF16, FP32 = torch.bfloat16, torch.float32
STEPS, LR, BETA2, EPS = 5, 1e-2, 0.999, 1e-8
WIDTH, BATCH = 16, 8


def _lr(step: int) -> float:
    """A schedule: the flat step reads the param group's lr each step."""
    return LR / (1 + step)


def _round_moments(opt: torch.optim.Optimizer) -> None:
    """The reference's bf16 storage: each moment rounded to nearest bf16, kept in fp32."""
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key].copy_(state[key].to(BF16))


# 1. one segment against torch's Adam, no processes --------------------------------------------

SEGMENTS = {  # numel, grad dtype, low-precision dtype, optimizer, weight decay, grad_mul, beta1
    "adamw": (1000, FP32, None, "AdamW", 0.1, 1.0, 0.9),
    "adamw-bf16-grads-scaled": (4099, BF16, BF16, "AdamW", 0.1, 0.3, 0.9),
    "adam-l2": (777, FP32, BF16, "Adam", 0.1, 1.0, 0.9),
    "lerp-from-the-end": (333, torch.float16, torch.float16, "AdamW", 0.0, 0.5, 0.3),
}


@pytest.mark.parametrize("case", list(SEGMENTS))
def test_segment_step_is_torch_adam_with_rounded_moments(case: str) -> None:
    n, grad_dtype, low_dtype, kind, decay, grad_mul, beta1 = SEGMENTS[case]
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(STEPS)]
    # the flat step (on the CPU: torch ops), its moments in bf16 from zero as torch's
    master, low = start.clone(), None if low_dtype is None else torch.empty(n, dtype=low_dtype)
    moments = torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16)
    for step, grad in enumerate(grads):
        hp = SegmentStep(grad_mul, _lr(step), decay, kind == "AdamW", beta1, BETA2, EPS, step + 1)
        step_segment(SegmentTensors(grad, master, *moments, low), hp)
    # the reference: torch's single-tensor Adam in fp32, its moments rounded after each step
    param = nn.Parameter(start.clone())
    cls = getattr(torch.optim, kind)
    ref = cls([param], lr=LR, betas=(beta1, BETA2), eps=EPS, weight_decay=decay, foreach=False)
    for step, grad in enumerate(grads):
        ref.param_groups[0]["lr"] = _lr(step)
        param.grad = grad.float() if grad_mul == 1.0 else grad.float().mul(grad_mul)
        ref.step()
        _round_moments(ref)
    assert torch.equal(master, param.detach())
    assert torch.equal(moments[0], ref.state[param]["exp_avg"].to(BF16))
    assert torch.equal(moments[1], ref.state[param]["exp_avg_sq"].to(BF16))
    if low is not None:
        assert torch.equal(low, master.to(low_dtype))


# 2. the optimizer's flat step against torch's Adam --------------------------------------------


def _optimizer(
    module: nn.Module,
    groups: list[dict[str, Any]] | None = None,
    *,
    moment_dtype: torch.dtype = BF16,
    flat: bool = True,
    bucket_size: int | None = None,
) -> tuple[DistributedOptimizer, DistributedDataParallel]:
    dp_group = init_process_groups(ParallelConfig()).dp
    ddp = DistributedDataParallel(module, dp_group=dp_group, bucket_size=bucket_size)
    params = groups or [{"params": list(ddp.parameters())}]
    adam = torch.optim.AdamW(params, lr=LR, betas=(0.9, BETA2), eps=EPS, weight_decay=0.1)
    return DistributedOptimizer(adam, ddp, flat_fused=flat, moment_dtype=moment_dtype), ddp


def _batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, 2 * WIDTH, generator=gen)
    return x.to(rank_device(), dtype), y.to(rank_device())


def _flat_is_torch_adam() -> str:
    """One 512-element weight: one launch over exactly the reference's tensor."""
    torch.manual_seed(0)
    module = nn.Linear(WIDTH, 2 * WIDTH, bias=False).to(rank_device())
    reference = nn.Linear(WIDTH, 2 * WIDTH, bias=False).to(rank_device())
    reference.load_state_dict(module.state_dict())
    opt, ddp = _optimizer(module)
    ref = torch.optim.AdamW(
        reference.parameters(), lr=LR, betas=(0.9, BETA2), eps=EPS, weight_decay=0.1, foreach=False
    )
    for step in range(STEPS):
        x, y = _batch(step, FP32)
        opt.zero_grad()
        opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"] = _lr(step)
        F.mse_loss(ddp(x), y).backward()
        assert opt.step().updated
        ref.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref.step()
        _round_moments(ref)
    [piece] = opt.state_dict()["params"]["weight"]["pieces"]
    want = ref.state[reference.weight]
    if rank_device().type == "cuda":  # the kernel, not these ops: test_flat_adamw's subject
        return "ok"
    assert torch.equal(module.weight, reference.weight)
    for key in ("exp_avg", "exp_avg_sq"):
        assert piece["state"][key].dtype == BF16, key
        assert torch.equal(piece["state"][key].float(), want[key].flatten()), key
    assert float(piece["state"]["step"]) == float(want["step"]) == STEPS
    return "ok"


def test_flat_step_is_torch_adam_with_rounded_moments(dist_pool: DistPool) -> None:
    assert dist_pool.run(_flat_is_torch_adam, 1) == ["ok"]


# 3. the buffers are bf16: half the moments' bytes ---------------------------------------------


def _net(dtype: torch.dtype = FP32) -> nn.Sequential:
    """Three 256-element weights (every shard and launch at dp 1 and 2 a multiple of 64)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(WIDTH, WIDTH, bias=False), nn.Tanh(), nn.Linear(WIDTH, WIDTH, bias=False),
        nn.Tanh(), nn.Linear(WIDTH, WIDTH, bias=False),
    )  # fmt: skip
    return net.to(rank_device(), dtype)


def _train(opt: DistributedOptimizer, ddp: DistributedDataParallel, steps: range) -> None:
    """The same batch on every rank (module doc)."""
    dtype = next(ddp.module.parameters()).dtype
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)
        for group in opt.param_groups:
            group["lr"] = _lr(step)
        opt.zero_grad()
        F.mse_loss(ddp(x.to(rank_device(), dtype)).float(), y.to(rank_device())).backward()
        assert opt.step().updated


def _state_bytes() -> str:
    reports = {}
    for dtype in (FP32, BF16):
        opt, ddp = _optimizer(_net(BF16), moment_dtype=dtype)
        _train(opt, ddp, range(1))
        assert opt._flat is not None
        for moments in opt._flat.moments:
            assert moments is not None and {m.dtype for m in moments} == {dtype}
        for state in opt.optimizer.state.values():
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == dtype
        reports[dtype] = opt.memory_report()
    numel = reports[FP32].num_params
    # each element's two moments lose 2 bytes each; the step counters stay as they were
    assert reports[FP32].state_bytes - reports[BF16].state_bytes == 2 * 2 * numel
    assert reports[FP32].total_bytes - reports[BF16].total_bytes == 4 * numel
    return "ok"


def test_moment_buffers_are_bf16(dist_pool: DistPool) -> None:
    assert dist_pool.run(_state_bytes, 1) == ["ok"]


# 4. contract: ZeRO-1 at dp 2 == dp 1, both with bf16 moments ----------------------------------


def _two_groups(ddp_params: list[nn.Parameter]) -> list[dict[str, Any]]:
    return [
        {"params": ddp_params[:2], "weight_decay": 0.1},
        {"params": ddp_params[2:], "weight_decay": 0.0},
    ]


def _weights_after_steps(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Two param groups, buckets of 512 elements: shards of 256 and 128 elements at dp 2."""
    module = _net(dtype)
    opt, ddp = _optimizer(module, _two_groups(list(module.parameters())), bucket_size=512)
    _train(opt, ddp, range(STEPS))
    assert opt._flat is not None and opt._flat.moments[0] is not None
    assert opt._flat.moments[0][0].dtype == BF16
    full = {}  # each rank's masters and moments, gathered: every element's state
    for name, entry in opt.state_dict()["params"].items():
        for piece in entry["pieces"]:
            full[f"{name} {piece['start']} master"] = piece["master"].cpu()
            for key in ("exp_avg", "exp_avg_sq"):
                full[f"{name} {piece['start']} {key}"] = piece["state"][key].cpu()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, full)
    weights = {n: p.detach().float().cpu() for n, p in module.named_parameters()}
    return {**weights, **{k: v for part in everyone for k, v in part.items()}}


def _state_by_param(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pieces of one parameter's state concatenated in order (dp 2 cuts them elsewhere)."""
    out: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for key, value in values.items():
        name, *rest = key.split(" ")
        if not rest:
            out.setdefault(name, []).append((0, value.flatten()))
            continue
        out.setdefault(f"{name} {rest[1]}", []).append((int(rest[0]), value))
    return {
        k: torch.cat([v for _, v in sorted(parts, key=lambda p: p[0])]) for k, parts in out.items()
    }


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32-params", "bf16-params"])
def test_zero1_dp2_equals_dp1(dist_pool: DistPool, dtype: torch.dtype) -> None:
    [one] = dist_pool.run(_weights_after_steps, 1, args=(dtype,))
    two = dist_pool.run(_weights_after_steps, 2, args=(dtype,))
    assert all(set(r) == set(two[0]) for r in two)
    want, got = _state_by_param(one), _state_by_param(two[0])
    assert want.keys() == got.keys() and len(want) == 3 * 4  # 3 weights: value, master, moments
    for key, value in want.items():
        assert value.dtype == got[key].dtype, key
        assert torch.equal(value, got[key]), f"{key}: dp 2 differs from dp 1"


# 5. checkpoints: either dtype loads into the other, and reshards ------------------------------


def _cross_load() -> str:
    """fp32 moments load rounded to nearest bf16, bf16 ones widened exactly, into the flat
    step and into torch's; a later step goes on from the converted moments."""
    saved = {}
    for dtype in (FP32, BF16):
        opt, ddp = _optimizer(_net(), moment_dtype=dtype)
        _train(opt, ddp, range(2))
        saved[dtype] = opt.state_dict()
    for src, dst, flat in ((FP32, BF16, True), (BF16, FP32, True), (BF16, FP32, False)):
        opt, ddp = _optimizer(_net(), moment_dtype=dst, flat=flat)
        opt.load_state_dict(saved[src])
        got = opt.state_dict()
        for name, entry in saved[src]["params"].items():
            for mine, theirs in zip(got["params"][name]["pieces"], entry["pieces"], strict=True):
                assert torch.equal(mine["master"], theirs["master"])
                for key in ("exp_avg", "exp_avg_sq"):
                    value = mine["state"][key]
                    assert value.dtype == dst, (src, dst, flat, key)
                    assert torch.equal(value, theirs["state"][key].to(dst)), (src, dst, key)
        _train(opt, ddp, range(2, 3))  # steps from the converted state
        assert all(torch.isfinite(p).all() for p in ddp.module.parameters())
    return "ok"


def test_a_state_of_either_moment_dtype_loads_into_the_other(dist_pool: DistPool) -> None:
    assert dist_pool.run(_cross_load, 1) == ["ok"]


def _save_at_dp2() -> dict[str, Any]:
    module = _net(BF16)
    opt, ddp = _optimizer(module, _two_groups(list(module.parameters())), bucket_size=512)
    _train(opt, ddp, range(2))
    return opt.state_dict()


def _load_at_dp1(shards: list[dict[str, Any]]) -> str:
    module = _net(BF16)
    opt, ddp = _optimizer(module, _two_groups(list(module.parameters())), bucket_size=512)
    opt.load_state_dict(shards)
    for name, entry in opt.state_dict()["params"].items():
        [piece] = entry["pieces"]
        for key in ("master", "exp_avg", "exp_avg_sq"):
            parts = []
            for shard in shards:
                for old in shard["params"][name]["pieces"]:
                    parts.append(
                        (old["start"], old["master"] if key == "master" else old["state"][key])
                    )
            saved = torch.cat([v for _, v in sorted(parts, key=lambda p: p[0])])
            value = piece["master"] if key == "master" else piece["state"][key]
            assert value.dtype == saved.dtype and torch.equal(value, saved), (name, key)
    _train(opt, ddp, range(2, 3))
    return "ok"


def test_bf16_moments_reshard_from_dp2_to_dp1(dist_pool: DistPool) -> None:
    shards = dist_pool.run(_save_at_dp2, 2)
    assert dist_pool.run(_load_at_dp1, 1, args=(shards,)) == ["ok"]


# 6. refusals -----------------------------------------------------------------------------------


def _refusal(case: str) -> str:
    dp_group = init_process_groups(ParallelConfig()).dp
    ddp = DistributedDataParallel(_net(), dp_group=dp_group)
    params = ddp.parameters()
    optimizer = torch.optim.SGD(params, lr=0.1) if case == "sgd" else torch.optim.AdamW(params)
    dtype = torch.float16 if case == "float16" else BF16
    try:
        DistributedOptimizer(
            optimizer, ddp, flat_fused=case != "not-flat", optimizer_offload=case == "offload",
            moment_dtype=dtype,
        )  # fmt: skip
    except ValueError as exc:
        return str(exc)
    return "no error"


REFUSALS = {
    "float16": "moment_dtype (torch.float16) must be torch.float32 or torch.bfloat16; pass one "
    "of those",
    "sgd": "moment_dtype (torch.bfloat16) stores Adam's two moments, but the optimizer is SGD; "
    "use torch.optim.AdamW or Adam, or moment_dtype torch.float32",
    "offload": "moment_dtype (torch.bfloat16) keeps the moments in the flat step's device "
    "buffers, but optimizer_offload is True (the host update keeps fp32 state); leave "
    "optimizer_offload False or use moment_dtype torch.float32",
    "not-flat": "moment_dtype (torch.bfloat16) keeps the moments in the flat step's buffers, "
    "but flat_fused is False; pass flat_fused=True or use moment_dtype torch.float32",
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusal_is_one_sentence(dist_pool: DistPool, case: str) -> None:
    [message] = dist_pool.run(_refusal, 1, args=(case,))
    assert message == REFUSALS[case]
    assert ". " not in message
