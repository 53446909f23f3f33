"""optimizer_offload: the update on host masters equals the on-device update; no fp32 state on
the device.

CPU (gloo, dp 2, ZeRO-1/2/3): both runs step with the same CPU kernels on the same values,
so they must agree bitwise (losses, gradient norms, skipped steps, parameters, masters and
Adam moments), with clipping active, fp16 parameters under a dynamic loss scaler, several
buckets and two parameter groups (the offloaded update steps shard by shard).

CUDA (marked; the lead runs it on the GPU, it has not run here; with and without
``overlap_host_update``, whose CPU tests are test_offload_overlap): the on-device update runs
torch's CUDA AdamW, the offloaded one the CPU kernel, so they agree to rounding: the bound
of ``assert_close_to_reference`` with n = the steps' chain of sums (as in test_contract).
Also checked there: the host masters are pinned, the optimizer state is on the CPU, and the
parameter shards stay on the GPU.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference
from mega_zero_optim import DistributedDataParallel, DistributedOptimizer, DynamicLossScaler

WIDTH, LAYERS, BATCH, STEPS, MICRO = 16, 4, 8, 3, 2
N = STEPS * (2 * LAYERS * WIDTH + BATCH)  # forward and back through the stack, the batch


def _net() -> nn.Sequential:
    mods: list[nn.Module] = []
    for _ in range(LAYERS):
        mods += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*mods)


def _train(
    sharding: str,
    dtype: torch.dtype,
    offload: bool,
    device: torch.device,
    fused: bool = False,
    overlap: bool = False,
) -> dict[str, Any]:
    groups = init_process_groups(ParallelConfig())
    torch.manual_seed(0)
    net = _net().to(device=device, dtype=dtype)
    ddp = DistributedDataParallel(net, dp_group=groups.dp, bucket_size=300, sharding=sharding)
    params = list(ddp.parameters())
    adamw = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
        ],
        lr=1e-2,
        eps=1e-4,
        fused=fused,
    )
    scaler = DynamicLossScaler(initial_scale=2.0**8) if dtype == torch.float16 else None
    opt = DistributedOptimizer(
        adamw,
        ddp,
        max_grad_norm=0.05,
        loss_scaler=scaler,
        optimizer_offload=offload,
        overlap_host_update=overlap,
    )
    dp, rank = ddp.dp_size, dist.get_rank(ddp.dp_group)
    per = BATCH // dp
    losses, norms, updated = [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(MICRO):
            g = torch.Generator().manual_seed(100 * step + m)
            x = torch.randn(BATCH, WIDTH, generator=g)[rank * per : (rank + 1) * per]
            y = torch.randn(BATCH, WIDTH, generator=g)[rank * per : (rank + 1) * per]
            with ddp.no_sync() if m < MICRO - 1 else nullcontext():
                out = ddp(x.to(device=device, dtype=dtype))
                loss = F.mse_loss(out.float(), y.to(device)) / MICRO
                opt.scale_loss(loss).backward()
            losses.append(float(loss))
        result = opt.step()
        norms.append(result.grad_norm)
        updated.append(result.updated)
    opt.wait()  # overlap_host_update: the last update done and its parameters gathered
    with ddp.gathered_parameters():
        weights = {n: p.detach().float().cpu().clone() for n, p in net.named_parameters()}
    state = opt.state_dict()
    pieces = {
        (name, piece["start"]): (
            piece["master"].cpu(),
            {k: v.cpu() for k, v in piece["state"].items()},
        )
        for name, entry in state["params"].items()
        for piece in entry["pieces"]
    }
    report = opt.memory_report()
    masters = [m for g in opt.param_groups for m in g["params"]]
    moments = [v for s in opt.optimizer.state.values() for v in s.values() if v.dim() > 0]
    shards = [s.bucket.param_shard for s in opt._shards]
    buffer_ptrs = {s.untyped_storage().data_ptr() for s in shards}
    return {
        "losses": losses,
        "norms": norms,
        "updated": updated,
        "weights": weights,
        "pieces": pieces,
        "report": report,
        "owned": sum(m.numel() for m in masters),
        "num_pieces": len(masters),
        "staging": dtype != torch.float32,
        "host_devices": {str(t.device) for t in masters + moments},
        # the masters (and gradients) travel; the moments, made by the optimizer, stay put
        "pinned": all(t.is_pinned() for t in masters) if offload else None,
        "shard_devices": {str(s.device) for s in shards},
        "masters_in_buffers": any(m.untyped_storage().data_ptr() in buffer_ptrs for m in masters),
    }


def _pair(sharding: str, dtype_name: str, fused: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    dtype = getattr(torch, dtype_name)
    cpu = torch.device("cpu")
    return _train(sharding, dtype, False, cpu, fused), _train(sharding, dtype, True, cpu, fused)


CASES = [
    (sharding, dtype, False)
    for sharding in ("optimizer", "gradients", "parameters")
    for dtype in ("float32", "float16")
] + [("optimizer", "float32", True)]


@pytest.mark.parametrize(("sharding", "dtype", "fused"), CASES)
def test_offload_equals_on_device_update(
    dist_pool: DistPool, sharding: str, dtype: str, fused: bool
) -> None:
    for ref, off in dist_pool.run(_pair, 2, args=(sharding, dtype, fused)):
        assert any(ref["updated"]), "at least one step must update"
        assert off["losses"] == ref["losses"]
        assert off["norms"] == ref["norms"] and off["updated"] == ref["updated"]
        assert min(n for n, u in zip(ref["norms"], ref["updated"], strict=True) if u) > 0.05
        for name, w in ref["weights"].items():
            assert torch.equal(off["weights"][name], w), name
        assert off["pieces"].keys() == ref["pieces"].keys()
        for key, (master, state) in ref["pieces"].items():
            got_master, got_state = off["pieces"][key]
            assert torch.equal(got_master, master), key
            assert got_state.keys() == state.keys()
            for k, v in state.items():
                assert torch.equal(got_state[k], v), (key, k)
        # no fp32 master or Adam moment on the device: all of it is host memory
        report = off["report"]
        assert report.master_bytes == 0 and report.state_bytes == 0
        owned, pieces = off["owned"], off["num_pieces"]
        staging = 2 if off["staging"] else 0
        # masters, gradients (4 + 4 bytes) and staging per padded shard element; Adam: two
        # fp32 moments per owned element and one 4-byte step per piece
        padded = report.host_bytes - (8 * owned + 4 * pieces)
        assert padded % (8 + staging) == 0 and padded // (8 + staging) >= owned
        assert report.param_bytes == ref["report"].param_bytes
        assert report.grad_bytes == ref["report"].grad_bytes
        assert report.total_bytes == ref["report"].total_bytes - ref["report"].master_bytes - (
            ref["report"].state_bytes
        )
        assert not off["masters_in_buffers"]


def _cuda_pair(sharding: str, overlap: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    cuda = torch.device("cuda", torch.cuda.current_device())
    return (
        _train(sharding, torch.float32, False, cuda),
        _train(sharding, torch.float32, True, cuda, overlap=overlap),
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (pinned memory, streams)")
@pytest.mark.parametrize("overlap", [False, True])  # overlap_host_update
@pytest.mark.parametrize("sharding", ["optimizer", "gradients", "parameters"])
def test_offload_on_cuda(dist_pool: DistPool, sharding: str, overlap: bool) -> None:
    [(ref, off)] = dist_pool.run(_cuda_pair, 1, args=(sharding, overlap))
    assert off["host_devices"] == {"cpu"} and off["pinned"]
    assert ref["host_devices"] != {"cpu"}  # the on-device run keeps them on the GPU
    assert all(d.startswith("cuda") for d in off["shard_devices"])
    assert off["report"].master_bytes == 0 and off["report"].state_bytes == 0
    assert off["updated"] == ref["updated"]
    assert_close_to_reference(
        torch.tensor(off["norms"]), torch.tensor(ref["norms"]), reduction_length=N, name="norms"
    )
    for name, w in ref["weights"].items():
        assert_close_to_reference(off["weights"][name], w, reduction_length=N, name=name)
