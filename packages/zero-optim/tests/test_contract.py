"""Contract: DDP + DistributedOptimizer over dp ranks == one process training on the whole batch.

Every rank feeds its own slice of each global batch; the reference is single-process
torch.optim.AdamW (or SGD) on the concatenated batch with the mean loss, computed inside the
rank function from the same seed.

Tolerance: fp32 on CPU, the rounding bound of ``assert_close_to_reference`` on parameters
and on the gradient norm, with n (``N``) the net's chain of sums over all steps. The
parallel run sums the same per-sample gradients in another order (per-rank means, then a
1/dp-scaled sum over ranks); that rounding (~1e-7 relative, ~1e-9 absolute here) is all that
differs. AdamW runs with eps=1e-4 rather than 1e-8: Adam divides by |g|, so on an element
whose gradient nearly cancels (a tied weight's two uses) a 1e-9 rounding difference would
become a step difference of order lr; eps caps that amplification at lr/eps = 100.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_zero_optim import DistributedDataParallel, DistributedOptimizer

IN, HIDDEN, OUT = 16, 32, 8
BATCH = 12  # samples per global microbatch, split evenly over dp in {1, 2, 4}
STEPS_MAX = 4  # the most steps a case trains
# forward through the four layers and back, then the batch for a weight gradient, each step
N = STEPS_MAX * (2 * (IN + 3 * HIDDEN + OUT) + BATCH)


class _Net(nn.Module):
    """A small MLP; optionally a tied weight, a frozen bias, and a branch some steps skip."""

    def __init__(self, *, tied: bool = False, frozen: bool = False, side: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.mid2 = nn.Linear(HIDDEN, HIDDEN)
        if tied:
            self.mid2.weight = self.mid.weight
        self.out = nn.Linear(HIDDEN, OUT)
        self.side = nn.Linear(HIDDEN, OUT) if side else None
        if frozen:
            self.mid.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        h = torch.tanh(self.inp(x))  # [b, in] -> [b, hidden]
        h = torch.tanh(self.mid(h))
        h = torch.tanh(self.mid2(h))
        y = self.out(h)  # [b, hidden] -> [b, out]
        if self.side is not None and use_side:
            y = y + self.side(h)
        return y


@dataclass(frozen=True)
class Case:
    steps: int = 4
    microbatches: int = 1
    max_grad_norm: float | None = None
    bucket_size: int | None = 1000
    tied: bool = False
    frozen: bool = False
    side: bool = False  # the side branch is skipped on odd steps: no gradient there
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    optimizer: str = "adamw"
    grad_reduce: str = "mean"
    use_distributed_optimizer: bool = True
    sharding: str = "optimizer"
    sync_each_micro: bool = False  # no no_sync(): every microbatch reduce-scatters
    prefetch: int = 1
    dp_shard: int | None = None  # HSDP: shard over this many dp ranks, replicate across


CASES = {
    "plain": Case(),
    "accumulation": Case(microbatches=3),
    "clipping": Case(max_grad_norm=0.05),
    "straddling": Case(bucket_size=300, microbatches=2),
    "one_bucket": Case(bucket_size=None),
    "frozen": Case(frozen=True),
    "tied": Case(tied=True),
    "no_grad_some_steps": Case(side=True),
    "no_overlap": Case(overlap_grad_reduce=False, microbatches=2),
    "param_gather_overlap": Case(overlap_param_gather=True, bucket_size=300),
    "sgd_momentum": Case(optimizer="sgd", max_grad_norm=0.05),
    "fused_clipping": Case(optimizer="adamw_fused", max_grad_norm=0.05, microbatches=2),
    "sum": Case(grad_reduce="sum"),
    "all_reduce": Case(use_distributed_optimizer=False, bucket_size=300),
}
# ZeRO-2 and ZeRO-3: the same contract; bucket_size 300 cuts a unit into several buckets,
# and at dp 4 (and dp 2 for the odd biases) parameters straddle dp shards
# (ZeRO-1 refuses a second synced backward in a step: no accumulation_each_micro there)
_SHARDED = {
    name: CASES[name]
    for name in (
        "plain accumulation clipping straddling one_bucket frozen tied no_grad_some_steps "
        "no_overlap fused_clipping sum"
    ).split()
}
_SHARDED["accumulation_each_micro"] = Case(microbatches=3, sync_each_micro=True)
for _stage in ("gradients", "parameters"):
    for _name, _case in _SHARDED.items():
        CASES[f"{_stage}_{_name}"] = replace(_case, sharding=_stage)
CASES["parameters_no_prefetch"] = Case(sharding="parameters", prefetch=0, bucket_size=300)
CASES["parameters_prefetch_2"] = Case(sharding="parameters", prefetch=2, bucket_size=300)
# HSDP at dp 4: shard 2 x replicate 2, and the two ends (shard 4 = plain ZeRO, shard 1 =
# plain DDP with every rank a replica); 3 AdamW steps with clipping active, straddling
# buckets, two microbatches
_HSDP = Case(steps=3, max_grad_norm=0.05, bucket_size=300, microbatches=2)
for _stage in ("optimizer", "gradients", "parameters"):
    for _shard in (1, 2, 4):
        CASES[f"hsdp{_shard}x{4 // _shard}_{_stage}"] = replace(
            _HSDP, sharding=_stage, dp_shard=_shard
        )


def _make_optimizer(kind: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    decay = [p for p in params if p.dim() > 1]
    no_decay = [p for p in params if p.dim() <= 1]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
        eps=1e-4,
        fused=kind == "adamw_fused",  # clipping then rides in the kernel's grad_scale
    )


def _batch(step: int, micro: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The global batch of (step, microbatch): [BATCH, IN] inputs and [BATCH, OUT] targets."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(BATCH, IN, generator=g)
    y = torch.randn(BATCH, OUT, generator=g)
    return x.to(device), y.to(device)


def _reference(
    case: Case, dp: int, device: torch.device, steps: range, losses: list[float] | None = None
) -> tuple[nn.Module, list[float]]:
    """Single-process training on the concatenated batches; returns the model and grad norms
    (and appends each step's loss to ``losses``)."""
    torch.manual_seed(0)
    net = _Net(tied=case.tied, frozen=case.frozen, side=case.side).to(device)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = _make_optimizer(case.optimizer, params)
    for p in params:  # a parameter without gradient in a step counts as a zero gradient
        p.grad = torch.zeros_like(p)
    norms = []
    for step in steps:
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for m in range(case.microbatches):
            x, y = _batch(step, m, device)
            loss = F.mse_loss(net(x, use_side=step % 2 == 0), y) / case.microbatches
            (loss * (dp if case.grad_reduce == "sum" else 1)).backward()
            total += float(loss)
        if losses is not None:
            losses.append(total)
        grads = [p.grad for p in params if p.grad is not None]
        norms.append(float(torch.nn.utils.get_total_norm(grads)))
        if case.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, case.max_grad_norm)
        opt.step()
    return net, norms


def _build(
    case: Case, device: torch.device
) -> tuple[DistributedDataParallel, DistributedOptimizer]:
    groups = init_process_groups(ParallelConfig(dp_shard=case.dp_shard))
    torch.manual_seed(0)
    net = _Net(tied=case.tied, frozen=case.frozen, side=case.side).to(device)
    ddp = DistributedDataParallel(
        net,
        dp_group=groups.dp if case.dp_shard is None else groups.dp_shard,
        replicate_group=None if case.dp_shard is None else groups.dp_replicate,
        bucket_size=case.bucket_size,
        overlap_grad_reduce=case.overlap_grad_reduce,
        use_distributed_optimizer=case.use_distributed_optimizer,
        grad_reduce=case.grad_reduce,
        sharding=case.sharding,
        prefetch=case.prefetch,
    )
    opt = DistributedOptimizer(
        _make_optimizer(case.optimizer, list(ddp.parameters())),
        ddp,
        max_grad_norm=case.max_grad_norm,
        overlap_param_gather=case.overlap_param_gather,
    )
    return ddp, opt


def _dp_rank_and_size(ddp: DistributedDataParallel) -> tuple[int, int]:
    """This rank's place among all data-parallel ranks (HSDP: shard rank fastest)."""
    rank = torch.distributed.get_rank(ddp.dp_group)
    if ddp.replicate_group is not None:
        rank += ddp.dp_size * torch.distributed.get_rank(ddp.replicate_group)
    return rank, ddp.dp_size * ddp.replicate_size


def _train(
    case: Case,
    ddp: DistributedDataParallel,
    opt: DistributedOptimizer,
    steps: range,
    losses: list[float] | None = None,
) -> list[float]:
    rank, dp = _dp_rank_and_size(ddp)
    per_rank = BATCH // dp
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    norms = []
    for step in steps:
        opt.zero_grad()
        total = torch.zeros((), device=rank_device())
        for m in range(case.microbatches):
            last = m == case.microbatches - 1
            with nullcontext() if last or case.sync_each_micro else ddp.no_sync():
                x, y = _batch(step, m, rank_device())
                out = ddp(x[mine], use_side=step % 2 == 0)
                loss = F.mse_loss(out, y[mine]) / case.microbatches
                loss.backward()
                total += loss.detach()
        if losses is not None:  # the global batch's loss: the mean of the ranks' means
            torch.distributed.all_reduce(total)
            losses.append(float(total) / dp)
        result = opt.step()
        assert result.updated
        norms.append(result.grad_norm)
    ddp.finish_param_sync()  # with overlap_param_gather the last gather waits for a forward
    return norms


def _assert_same_params(ddp: DistributedDataParallel, ref: nn.Module) -> float:
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    with ddp.gathered_parameters():  # ZeRO-3 keeps only shards between uses
        for name, p in ddp.module.named_parameters():
            assert_close_to_reference(p, ref_params[name], reduction_length=N, name=name)
            worst = max(worst, float((p - ref_params[name]).abs().max()))
    return worst


def _check_case(name: str) -> float:
    case = CASES[name]
    ddp, opt = _build(case, rank_device())
    steps = range(case.steps)
    losses: list[float] = []
    ref_losses: list[float] = []
    norms = _train(case, ddp, opt, steps, losses)
    dp = _dp_rank_and_size(ddp)[1]
    ref, ref_norms = _reference(case, dp, rank_device(), steps, ref_losses)
    assert_close_to_reference(
        torch.tensor(norms), torch.tensor(ref_norms), reduction_length=N, name="grad norms"
    )
    assert_close_to_reference(
        torch.tensor(losses), torch.tensor(ref_losses), reduction_length=N, name="losses"
    )
    if case.dp_shard is not None:
        assert (ddp.dp_size, ddp.replicate_size) == (case.dp_shard, 4 // case.dp_shard)
    if case.max_grad_norm is not None:
        assert min(ref_norms) > case.max_grad_norm, "clipping must be active in this case"
    if case.bucket_size == 300 and case.sharding == "optimizer":
        names = [n for info in ddp.bucket_info() for n in info.params]  # some in two buckets
        assert len(names) > len(set(names))
    if case.bucket_size == 300 and case.sharding != "optimizer":
        buffer = ddp.param_and_grad_buffers[0]  # buckets end at parameter boundaries
        assert all(len(buffer.buckets_of[id(p)]) == 1 for p in buffer.params)
        if ddp.dp_size > 1:  # ... and some parameter straddles two dp shards
            cuts = [
                b.where.start + k * b.where.size // ddp.dp_size
                for b in buffer.buckets
                for k in range(1, ddp.dp_size)
            ]
            assert any(r.start < c < r.end for r in buffer.ranges for c in cuts)
    if case.frozen:
        frozen = ddp.module.mid.bias
        assert not hasattr(frozen, "main_grad")
    return _assert_same_params(ddp, ref)


# the sharded stages at dp 1 have nothing to shard: only their plain cases run there
@pytest.mark.parametrize(
    ("name", "dp"),
    [
        (name, dp)
        for name in CASES
        for dp in (
            (4,)
            if CASES[name].dp_shard is not None
            else (1, 2, 4)
            if CASES[name].sharding == "optimizer" or name.endswith("_plain")
            else (2, 4)
        )
    ],
)
def test_matches_single_process(dist_pool: DistPool, name: str, dp: int) -> None:
    dist_pool.run(_check_case, dp, args=(name,))  # each rank asserts its parameters


# re-sharding a checkpoint ------------------------------------------------------------------


def _save_then_stop(bucket_size: int, folder: str, steps: int) -> None:
    case = replace(CASES["plain"], bucket_size=bucket_size)
    ddp, opt = _build(case, rank_device())
    _train(case, ddp, opt, range(steps))
    rank = torch.distributed.get_rank()
    torch.save(opt.state_dict(), os.path.join(folder, f"rank{rank}.pt"))


def _load_and_continue(bucket_size: int, folder: str, old_dp: int, steps: int, total: int) -> float:
    case = replace(CASES["plain"], bucket_size=bucket_size)
    ddp, opt = _build(case, rank_device())
    rank = torch.distributed.get_rank()
    files = [f"rank{r}.pt" for r in range(old_dp)] if old_dp != ddp.dp_size else [f"rank{rank}.pt"]
    shards = [
        torch.load(os.path.join(folder, f), map_location=rank_device(), weights_only=True)
        for f in files
    ]
    opt.load_state_dict(shards if len(shards) > 1 else shards[0])
    assert opt.num_steps == steps
    _train(case, ddp, opt, range(steps, total))
    ref, _ = _reference(case, ddp.dp_size, rank_device(), range(total))
    return _assert_same_params(ddp, ref)


@pytest.mark.parametrize(("old_dp", "new_dp"), [(4, 2), (2, 2), (1, 4)])
def test_state_dict_reshards(
    dist_pool: DistPool, tmp_path: object, old_dp: int, new_dp: int
) -> None:
    folder = str(tmp_path)
    dist_pool.run(_save_then_stop, old_dp, args=(300, folder, 3))
    # at another dp size the new run also cuts its buckets differently: the format must not
    # care; at the same dp size (same layout) each rank loads its own shard only
    new_bucket_size = 300 if old_dp == new_dp else 500
    dist_pool.run(_load_and_continue, new_dp, args=(new_bucket_size, folder, old_dp, 3, 5))


def _load_into_swapped_groups(folder: str) -> list[tuple[list[int], float]]:
    """Load a state saved with groups [decay 0.1, no decay 0.0] into an optimizer built with
    them the other way round: each group keeps the hyperparameters of its own parameters."""
    case = CASES["plain"]
    groups = init_process_groups(ParallelConfig())
    torch.manual_seed(0)
    net = _Net().to(rank_device())
    ddp = DistributedDataParallel(net, dp_group=groups.dp, bucket_size=case.bucket_size)
    params = list(ddp.parameters())
    swapped = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.5},
            {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.5},
        ],
        lr=1e-2,
        eps=1e-4,
    )
    opt = DistributedOptimizer(swapped, ddp)
    opt.load_state_dict(torch.load(os.path.join(folder, "rank0.pt"), weights_only=True))
    dims = {name: p.dim() for name, p in net.named_parameters()}
    return [
        (sorted({dims[n] for n in names}), g["weight_decay"])
        for names, g in zip(opt._group_names, opt.optimizer.param_groups, strict=True)
    ]


def test_loaded_hyperparameters_follow_the_parameters(
    dist_pool: DistPool, tmp_path: object
) -> None:
    folder = str(tmp_path)
    dist_pool.run(_save_then_stop, 1, args=(300, folder, 1))
    [loaded] = dist_pool.run(_load_into_swapped_groups, 1, args=(folder,))
    assert loaded == [([1], 0.0), ([2], 0.1)]
