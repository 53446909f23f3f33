"""overlap_host_update: the offloaded update on a worker thread, overlapping the next forward.

CPU (gloo, dp 2). The overlapped update runs the same CPU kernels on the same values as the
synchronous offload and the on-device update, so all three agree bitwise: losses, clipped
norms, an eval forward and a second forward run while the update is in flight, a
``state_dict()`` taken right after ``step()``, the final weights and Adam state. The LR is
changed while each update runs (as a trainer does before its next step), which the update
must not see.

The overlap is traced without sleeping: the worker's update of the last shard waits for an
event that the first layer's forward sets (bounded by a timeout that only a serial update
would reach), and the worker, the uploads and the layers' pre-hooks append to one log.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool
from mega_zero_optim import DistributedDataParallel, DistributedOptimizer, DynamicLossScaler
from mega_zero_optim.host_update import ShardStep
from mega_zero_optim.offload import Offloader

WIDTH, LAYERS, BATCH, STEPS, LR = 16, 4, 8, 3, 1e-2


def _build(
    sharding: str, mode: str, *, fused: bool = False, scaler: DynamicLossScaler | None = None
) -> tuple[nn.Sequential, DistributedDataParallel, DistributedOptimizer]:
    """mode: 'device' (no offload), 'sync' (offload) or 'overlap' (offload, overlapped)."""
    groups = init_process_groups(ParallelConfig())
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])
    ddp = DistributedDataParallel(net, dp_group=groups.dp, bucket_size=300, sharding=sharding)
    params = list(ddp.parameters())
    adamw = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
        ],
        lr=LR,
        eps=1e-4,
        fused=fused,
    )
    opt = DistributedOptimizer(
        adamw,
        ddp,
        max_grad_norm=0.05,
        loss_scaler=scaler,
        optimizer_offload=mode != "device",
        overlap_host_update=mode == "overlap",
    )
    return net, ddp, opt


def _batch(step: int, rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    per = BATCH // dp
    x = torch.randn(BATCH, WIDTH, generator=g)[rank * per : (rank + 1) * per]
    y = torch.randn(BATCH, WIDTH, generator=g)[rank * per : (rank + 1) * per]
    return x, y


def _train_step(ddp: DistributedDataParallel, opt: DistributedOptimizer, step: int) -> float:
    x, y = _batch(step, dist.get_rank(ddp.dp_group), ddp.dp_size)
    opt.zero_grad()
    loss = F.mse_loss(ddp(x), y)
    loss.backward()
    return float(loss.detach())


def _tensors(state: dict[str, Any]) -> dict[tuple[str, int, str], torch.Tensor]:
    return {
        (name, piece["start"], key): value.clone()
        for name, entry in state["params"].items()
        for piece in entry["pieces"]
        for key, value in [("master", piece["master"]), *piece["state"].items()]
    }


def _train(sharding: str, mode: str, fused: bool) -> dict[str, Any]:
    net, ddp, opt = _build(sharding, mode, fused=fused)
    probe = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(7))
    losses, norms, evals = [], [], []
    early: dict[tuple[str, int, str], torch.Tensor] = {}
    for step in range(STEPS):
        for g in opt.param_groups:  # set while the last update may run: this step's LR
            g["lr"] = LR * (1 + step)
        if step > 0:
            with torch.no_grad():  # the update in flight: the hooks wait for it
                evals.append(ddp(probe).clone())
        losses.append(_train_step(ddp, opt, step))
        result = opt.step()
        assert result.updated
        norms.append(result.grad_norm)
        if step == 0:
            early = _tensors(opt.state_dict())
    with torch.no_grad():  # two forwards before any wait
        evals += [ddp(probe).clone(), ddp(probe + 1).clone()]
    opt.wait()
    with ddp.gathered_parameters():
        weights = {n: p.detach().clone() for n, p in net.named_parameters()}
    return {
        "losses": losses,
        "norms": norms,
        "evals": evals,
        "early": early,
        "final": _tensors(opt.state_dict()),
        "weights": weights,
    }


def _runs(sharding: str, fused: bool) -> dict[str, dict[str, Any]]:
    return {mode: _train(sharding, mode, fused) for mode in ("device", "sync", "overlap")}


def _assert_equal(got: dict[Any, torch.Tensor], want: dict[Any, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


# ZeRO-1 with the fused kernel (clipping through grad_scale), ZeRO-3 with the foreach one;
# at dp 1 (no gather: the optimizer's own pre-hooks upload the shards) ZeRO-2
CASES = [("optimizer", True, 2), ("parameters", False, 2), ("gradients", True, 1)]


@pytest.mark.parametrize(("sharding", "fused", "dp"), CASES)
def test_overlapped_update_equals_the_synchronous_one(
    dist_pool: DistPool, sharding: str, fused: bool, dp: int
) -> None:
    for runs in dist_pool.run(_runs, dp, args=(sharding, fused)):
        ref = runs["sync"]
        assert min(ref["norms"]) > 0.05  # clipping is active every step
        for mode in ("device", "overlap"):
            got = runs[mode]
            assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"], mode
            assert len(got["evals"]) == len(ref["evals"]) == STEPS + 1
            for a, b in zip(got["evals"], ref["evals"], strict=True):
                assert torch.equal(a, b), mode
            _assert_equal(got["weights"], ref["weights"])
            _assert_equal(got["early"], ref["early"])
            _assert_equal(got["final"], ref["final"])


def _trace(sharding: str) -> dict[str, Any]:
    """Log the second step's host updates, uploads and the next forward's layers."""
    net, ddp, opt = _build(sharding, "overlap")
    _train_step(ddp, opt, 0)
    opt.step()
    opt.wait()
    log: list[tuple[str, int]] = []
    release = threading.Event()
    index_of = {
        b.param_shard.data_ptr(): b.index
        for buffer in ddp.param_and_grad_buffers
        for b in buffer.buckets
    }
    run, params_up = ShardStep.run, Offloader.params_up

    def gated_run(self: ShardStep) -> None:
        k = self.bucket.index  # type: ignore[attr-defined]
        if k == 0 and not release.wait(timeout=30):  # bucket 0: the last the forward uses
            log.append(("timed out", k))
        log.append(("update", k))
        run(self)
        log.append(("updated", k))

    def traced_params_up(self: Offloader, shard: Any) -> None:
        params_up(self, shard)
        log.append(("upload", index_of[shard.param_shard.data_ptr()]))

    def forward_hook(layer: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            log.append(("forward", layer))
            release.set()

        return hook

    _train_step(ddp, opt, 1)
    ShardStep.run, Offloader.params_up = gated_run, traced_params_up  # type: ignore[method-assign]
    handles = []
    try:
        opt.step()
        log.append(("step returned", -1))
        handles = [net[2 * i].register_forward_pre_hook(forward_hook(i)) for i in range(LAYERS)]
        _train_step(ddp, opt, 2)  # the next forward (and backward)
        opt.wait()
    finally:
        ShardStep.run, Offloader.params_up = run, params_up  # type: ignore[method-assign]
        for h in handles:
            h.remove()
    buckets_of_layer = {
        i: sorted(
            {b.index for b in ddp.bucket_info() if any(n.startswith(f"{2 * i}.") for n in b.params)}
        )
        for i in range(LAYERS)
    }
    return {"log": log, "buckets": buckets_of_layer, "num_buckets": len(ddp.bucket_info())}


@pytest.mark.parametrize("sharding", ["optimizer", "parameters"])
def test_update_overlaps_the_next_forward_in_order(dist_pool: DistPool, sharding: str) -> None:
    for got in dist_pool.run(_trace, 2, args=(sharding,)):
        log, buckets = got["log"], got["buckets"]
        assert ("timed out", 0) not in log, "the forward waited for the whole update"
        at = {event: i for i, event in enumerate(log)}
        assert len(at) == len(log)  # each event once
        # (a) step() returned before the last shard's update ran
        assert at["step returned", -1] < at["update", 0]
        # (b) the first layer's forward started before the last shard's update finished
        assert at["forward", 0] < at["updated", 0]
        # (c) no layer ran before its own shards were updated and uploaded
        for layer, indices in buckets.items():
            assert indices
            for k in indices:
                assert at["updated", k] < at["upload", k] < at["forward", layer], (layer, k)
        # the worker ran every shard once, in the forward's order (bucket n-1 first)
        updates = [k for event, k in log if event == "update"]
        assert updates == list(reversed(range(got["num_buckets"])))


def _failures() -> dict[str, Any]:
    found: dict[str, Any] = {}
    ran: list[int] = []
    run = ShardStep.run

    def failing_run(self: ShardStep) -> None:
        ran.append(self.bucket.index)  # type: ignore[attr-defined]
        if self.bucket.index == 0:  # type: ignore[attr-defined]
            raise ValueError("injected")
        run(self)

    ShardStep.run = failing_run  # type: ignore[method-assign]
    try:
        # a step skipped for non-finite gradients starts no update
        _, ddp, opt = _build("optimizer", "overlap", scaler=DynamicLossScaler(initial_scale=4.0))
        opt.zero_grad()
        x, _ = _batch(0, dist.get_rank(ddp.dp_group), ddp.dp_size)
        opt.scale_loss(ddp(x).sum() * float("inf")).backward()
        found["skipped"] = not opt.step().updated
        opt.wait()
        found["ran_after_skip"] = list(ran)
        # a failing update: one RuntimeError at the next wait, and at every later one
        _, ddp, opt = _build("optimizer", "overlap")
        _train_step(ddp, opt, 0)
        opt.step()
        messages = []
        for wait in (opt.wait, opt.wait, opt.state_dict):
            with pytest.raises(RuntimeError) as info:
                wait()
            messages.append(str(info.value))
            found["cause"] = repr(info.value.__cause__)
        found["messages"] = messages
    finally:
        ShardStep.run = run  # type: ignore[method-assign]
    with pytest.raises(ValueError) as bad:
        _build_unoffloaded_overlap()
    found["value_error"] = str(bad.value)
    return found


def _build_unoffloaded_overlap() -> None:
    groups = init_process_groups(ParallelConfig())
    ddp = DistributedDataParallel(nn.Linear(2, 2), dp_group=groups.dp)
    DistributedOptimizer(torch.optim.AdamW(ddp.parameters()), ddp, overlap_host_update=True)


def test_failures_surface_at_the_next_wait(dist_pool: DistPool) -> None:
    for got in dist_pool.run(_failures, 2):
        assert got["skipped"] and got["ran_after_skip"] == []
        first, *later = got["messages"]
        assert first == (
            "the offloaded optimizer update of step 1 failed on its shard 3 (ValueError: "
            "injected); the shards from there on are not updated, so training cannot go on "
            "from this optimizer"
        )
        assert "\n" not in first and later == [first, first]
        assert got["cause"] == "ValueError('injected')"
        assert got["value_error"] == (
            "overlap_host_update (True) overlaps the offloaded host update with the next "
            "forward, but optimizer_offload is False; pass optimizer_offload=True or leave "
            "overlap_host_update False"
        )


class _BlockedStep:
    """A shard update that runs only once the test lets it (no sleeps)."""

    def __init__(self, release: threading.Event) -> None:
        self.bucket = object()
        self.release, self.ran = release, False

    def run(self) -> None:
        assert self.release.wait(timeout=60), "the test never released the update"
        self.ran = True


def test_an_update_in_flight_at_exit_is_joined_first() -> None:
    """The interpreter's exit waits for a running update: a daemon thread still inside
    torch's CPU kernels when torch is torn down aborted the process on the GPU machine."""
    from mega_zero_optim import host_update

    release, joined = threading.Event(), threading.Event()
    step = _BlockedStep(release)
    update = host_update.HostUpdate(None)  # type: ignore[arg-type]  # begin needs no offloader
    update.begin([step], [], number=1)  # type: ignore[list-item]
    assert update._thread in host_update._RUNNING and not step.ran

    def exit_() -> None:  # what atexit runs, on a thread of its own
        host_update._join_at_exit()
        joined.set()

    threading.Thread(target=exit_, daemon=True).start()
    # while the update is held, the exit must not get past the join (a join that returned
    # at once would set the event well inside this bound)
    assert not joined.wait(timeout=0.5), "the exit did not wait for the update"
    release.set()
    assert joined.wait(timeout=60) and step.ran and not host_update._RUNNING
