"""Shared experts overlapped with the dispatch, and router losses fed through backward."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mega_moe import MoEConfig, MoELayer, RouterConfig
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device

H = 16
ROUTER = RouterConfig(num_experts=8, top_k=2, aux_loss_coeff=0.1, z_loss_coeff=0.01)


def _grads(layer: MoELayer, x: torch.Tensor, dy: torch.Tensor, extra: float) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    out = layer(x)
    assert layer.last_stats is not None
    loss = (out * dy).sum()
    if extra:
        loss = loss + extra * layer.last_stats.loss
    loss.backward()
    assert x.grad is not None
    grads = [out.detach(), x.grad]
    grads += [p.grad.clone() for p in layer.parameters() if p.grad is not None]
    layer.zero_grad()
    return grads


def _overlap_and_attach(sp: bool) -> None:
    groups = init_process_groups(ParallelConfig(tp=2, ep=2, etp=1))
    dev = rank_device()
    kw = {
        "ep_group": groups.ep,
        "tp_group": groups.tp,
        "sequence_parallel": sp,
        "seed": 4,
        "name": "moe",
        "device": dev,
    }
    plain = MoEConfig(router=ROUTER, ffn_hidden_size=32, shared_ffn_size=16)
    overlap = MoEConfig(
        router=ROUTER,
        ffn_hidden_size=32,
        shared_ffn_size=16,
        overlap_shared_experts=True,
        aux_loss_in_backward=True,
    )
    a, b = MoELayer(H, plain, **kw), MoELayer(H, overlap, **kw)
    b.aux_loss_scale = 0.5
    s = 8 // 2 if sp else 8
    x, dy = torch.randn(s, 3, H, device=dev), torch.randn(s, 3, H, device=dev)
    # overlapping computes the same thing; the attached losses' gradient is 0.5 * d(loss)
    for ga, gb in zip(_grads(a, x, dy, 0.5), _grads(b, x, dy, 0.0), strict=True):
        assert_close_to_reference(ga, gb, reduction_length=2 * (2 * H + 32) + 2 * s * 3,
                                  name="overlapped layer grad")  # fmt: skip
    assert dist.get_world_size() == 2


def test_overlap_and_backward_losses(dist_pool: DistPool) -> None:
    for sp in (False, True):
        dist_pool.run(_overlap_and_attach, 2, args=(sp,))
