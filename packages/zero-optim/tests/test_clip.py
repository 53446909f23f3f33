"""Global gradient norm across dp and tp (tp replicas counted once), non-finite gradients.

Comparisons are fp32 on CPU: the rounding bound of ``assert_close_to_reference`` (the same
sums in another order; n = ``N``), except the fp16 run's masters against an fp32 step (see
FP16_ATOL).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_zero_optim import (
    DistributedDataParallel,
    DistributedOptimizer,
    DynamicLossScaler,
)
from mega_zero_optim.clip import counts_in_norm

ROWS, COLS, BATCH = 8, 6, 8
# the longest chain of sums: up to 4 steps of three 8-wide layers forward and back, then
# the batch (4 per rank, dp <= 4) for a weight gradient
N = 4 * (2 * 3 * ROWS + 4 * 4)


@dataclass(frozen=True)
class _Spec:
    """Stands in for mega_tp_layers' ShardSpec (this package must not import it)."""

    dim: int | None
    num_shards: int
    shard_rank: int
    group: str
    full_shape: tuple[int, ...]
    duplicate: bool


def test_counts_in_norm_reads_the_duplicate_flag() -> None:
    plain = nn.Parameter(torch.zeros(2))
    assert counts_in_norm(plain)
    replica = nn.Parameter(torch.zeros(2))
    replica.mega_shard = _Spec(None, 2, 1, "tp", (2,), duplicate=True)  # type: ignore[attr-defined]
    assert not counts_in_norm(replica)
    bad = nn.Parameter(torch.zeros(2))
    bad.mega_shard = "tp"  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="has no 'duplicate' field"):
        counts_in_norm(bad)


class _RowShard(nn.Module):
    """y = x @ W + b with W split by rows over tp and b replicated over tp."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor, tp_group: dist.ProcessGroup) -> None:
        super().__init__()
        self.tp_group = tp_group
        tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        self.rows = slice(rank * ROWS // tp, (rank + 1) * ROWS // tp)
        self.w = nn.Parameter(w[self.rows].clone())
        self.w.mega_shard = _Spec(0, tp, rank, "tp", (ROWS, COLS), duplicate=False)  # type: ignore[attr-defined]
        self.b = nn.Parameter(b.clone())
        self.b.mega_shard = _Spec(None, tp, rank, "tp", (COLS,), duplicate=rank != 0)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = x[:, self.rows] @ self.w  # [n, rows/tp] @ [rows/tp, cols] -> [n, cols]
        total = partial.detach().clone()
        dist.all_reduce(total, group=self.tp_group)
        # forward: the full product; backward: the gradient of the local partial product
        return partial + (total - partial.detach()) + self.b


def _tp_dp_clipping() -> None:
    groups = init_process_groups(ParallelConfig(tp=2))
    dev = rank_device()
    torch.manual_seed(0)
    w, b = torch.randn(ROWS, COLS, device=dev), torch.randn(COLS, device=dev)
    shard = _RowShard(w, b, groups.tp)
    ddp = DistributedDataParallel(shard, dp_group=groups.dp, bucket_size=7)
    opt = DistributedOptimizer(
        torch.optim.AdamW(ddp.parameters(), lr=1e-2, eps=1e-4), ddp, max_grad_norm=0.1
    )  # grad_norm_group defaults to the world: dp x tp
    ref_w, ref_b = nn.Parameter(w.clone()), nn.Parameter(b.clone())
    ref_opt = torch.optim.AdamW([ref_w, ref_b], lr=1e-2, eps=1e-4)
    dp, dp_rank = groups.size("dp"), groups.rank("dp")
    per = BATCH // dp
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, ROWS, generator=g).to(dev)
        y = torch.randn(BATCH, COLS, generator=g).to(dev)
        opt.zero_grad()
        mine = slice(dp_rank * per, (dp_rank + 1) * per)
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        result = opt.step()
        ref_opt.zero_grad()
        F.mse_loss(x @ ref_w + ref_b, y).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_([ref_w, ref_b], 0.1))
        assert ref_norm > 0.1, "clipping must be active"
        ref_opt.step()
        assert_close_to_reference(
            torch.tensor(result.grad_norm), torch.tensor(ref_norm), reduction_length=N,
            name=f"step {step} grad norm",
        )  # fmt: skip
    w_scale = float(ref_w.detach().abs().max())  # the whole weight's scale, not the shard's
    assert_close_to_reference(shard.w, ref_w.detach()[shard.rows], reduction_length=N,
                              name="w", scale=w_scale)  # fmt: skip
    assert_close_to_reference(shard.b, ref_b.detach(), reduction_length=N, name="b")


def test_norm_and_clipping_over_tp_and_dp(dist_pool: DistPool) -> None:
    dist_pool.run(_tp_dp_clipping, 4)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)
    ).to(rank_device())


def _nonfinite(use_scaler: bool, bad_step: int, sharding: str = "optimizer") -> dict[str, object]:
    """Train 4 steps of a loss-scaled (or plain) run; rank 1 poisons a gradient at bad_step."""
    groups = init_process_groups(ParallelConfig())
    ddp = DistributedDataParallel(
        _net(), dp_group=groups.dp, bucket_size=20, overlap_grad_reduce=False, sharding=sharding
    )  # reduced in step(), after the poisoning below
    scaler = DynamicLossScaler(initial_scale=1024.0, hysteresis=1) if use_scaler else None
    opt = DistributedOptimizer(
        torch.optim.AdamW(ddp.parameters(), lr=1e-2, eps=1e-4), ddp, loss_scaler=scaler
    )
    ref = _net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)
    dp, rank = ddp.dp_size, dist.get_rank()
    results = []
    for step in range(1, 5):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4 * dp, 8, generator=g).to(rank_device())
        y = torch.randn(4 * dp, 2, generator=g).to(rank_device())
        opt.zero_grad()
        loss = F.mse_loss(ddp(x[4 * rank : 4 * rank + 4]), y[4 * rank : 4 * rank + 4])
        opt.scale_loss(loss).backward()
        if step == bad_step and rank == 1:
            ddp.module[2].weight.main_grad[3, 5] = float("nan")
        try:
            result = opt.step()
        except FloatingPointError as exc:
            return {"error": str(exc)}
        results.append((result.updated, result.loss_scale))
        if result.updated:  # the reference skips the step the scaler skipped
            ref_opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
    with ddp.gathered_parameters():
        for (name, p), r in zip(ddp.module.named_parameters(), ref.parameters(), strict=True):
            assert_close_to_reference(p, r, reduction_length=N, name=name)
    return {"results": results}


def test_nan_gradient_names_step_and_parameter(dist_pool: DistPool) -> None:
    for got in dist_pool.run(_nonfinite, 2, args=(False, 3)):
        message = str(got["error"])
        assert message.startswith("step 3: the gradient of '2.weight' holds nan or inf"), message
        assert "\n" not in message


@pytest.mark.parametrize("sharding", ["optimizer", "gradients", "parameters"])
def test_loss_scaler_skips_the_step_and_backs_off(dist_pool: DistPool, sharding: str) -> None:
    for got in dist_pool.run(_nonfinite, 2, args=(True, 2, sharding)):
        # power-of-two scaling is exact, so the scaled run equals the plain reference
        assert got["results"] == [(True, 1024.0), (False, 1024.0), (True, 512.0), (True, 512.0)]


# The fp16 run's AdamW. Its first update of an element is lr * g / (|g| + eps) (m = g, v = g^2
# after bias correction), whose slope in g is at most lr / eps: a gradient off by d moves the
# master by at most lr * d / eps. With eps = 1, above every |g| here (< FP16_MAX_GRAD, asserted),
# the update is nearly linear in g: it depends on the gradient's size, not only on its sign.
FP16_LR, FP16_EPS, FP16_MAX_GRAD = 1e-2, 1.0, 0.5
# fp16 forward and backward round every activation and gradient to 11 bits: the reduced
# gradient of a parameter is off by a few units of 2^-11 times its largest element (measured:
# at most 1.3 units). Allowing 4 units bounds a master's error by lr / eps * 4 * 2^-11 *
# FP16_MAX_GRAD = 1e-5 (+ 1e-6 for the fp32 update itself), while a gradient left scaled or off
# by a factor 2 moves some master by more than 1e-3.
FP16_ATOL = FP16_LR / FP16_EPS * 4 * 2.0**-11 * FP16_MAX_GRAD + 1e-6


def _check_first_update(
    opt: DistributedOptimizer, start: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> None:
    """This rank's fp32 masters after the first update equal one plain fp32 AdamW step from
    the same fp16-valued weights on the same batch (every rank trains on all of it)."""
    ref = _net()
    ref.load_state_dict({k: v.float() for k, v in start.items()})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=FP16_LR, eps=FP16_EPS)
    F.mse_loss(ref(x.float()), y).backward()
    largest = max(float(p.grad.abs().max()) for p in ref.parameters())  # type: ignore[union-attr]
    assert largest < FP16_MAX_GRAD, f"largest gradient {largest}: raise FP16_MAX_GRAD"
    ref_opt.step()
    expected = {n: p.detach().flatten() for n, p in ref.named_parameters()}
    for name, entry in opt.state_dict()["params"].items():
        for piece in entry["pieces"]:
            torch.testing.assert_close(
                piece["master"],
                expected[name][piece["start"] : piece["end"]],
                rtol=0.0,
                atol=FP16_ATOL,
                msg=lambda m, n=name: f"{n}: {m}",
            )


def _fp16(sharding: str) -> dict[str, object]:
    groups = init_process_groups(ParallelConfig())
    net = _net().half()
    before = [p.detach().clone() for p in net.parameters()]  # ZeRO-3 keeps shards only
    start = {k: v.clone() for k, v in net.state_dict().items()}  # skipped steps keep these
    ddp = DistributedDataParallel(net, dp_group=groups.dp, bucket_size=50, sharding=sharding)
    # 2^20 overflows fp16 gradients: the first steps are skipped until the scale fits
    scaler = DynamicLossScaler(initial_scale=2.0**20, hysteresis=1, max_scale=2.0**20)
    opt = DistributedOptimizer(
        torch.optim.AdamW(ddp.parameters(), lr=FP16_LR, eps=FP16_EPS), ddp, loss_scaler=scaler
    )
    updated = []
    for step in range(12):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 8, generator=g).to(rank_device()).half()
        y = torch.randn(4, 2, generator=g).to(rank_device())
        opt.zero_grad()
        opt.scale_loss(F.mse_loss(ddp(x).float(), y)).backward()
        result = opt.step()
        if result.updated and True not in updated:  # the first update: Adam's state starts here
            _check_first_update(opt, start, x, y)
        updated.append(result.updated)
    state = opt.state_dict()["params"]
    with ddp.gathered_parameters():
        moved = any(not torch.equal(a, p) for a, p in zip(before, net.parameters(), strict=True))
        for name, p in net.named_parameters():  # fp16 parameters: the rounding of fp32 masters
            for piece in state[name]["pieces"]:
                assert torch.equal(
                    p.detach().flatten()[piece["start"] : piece["end"]], piece["master"].half()
                )
    return {"updated": updated, "scale": scaler.scale, "moved": moved}


@pytest.mark.parametrize("sharding", ["optimizer", "gradients", "parameters"])
def test_fp16_training_with_dynamic_scaling(dist_pool: DistPool, sharding: str) -> None:
    got = dist_pool.run(_fp16, 2, args=(sharding,))[0]
    updated = got["updated"]
    assert isinstance(updated, list)
    assert not updated[0] and updated[-1] and got["moved"]
    # hysteresis 1 and no growth within 12 steps: each skipped step halved the scale once
    assert got["scale"] == 2.0**20 / 2 ** updated.count(False)
