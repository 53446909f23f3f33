"""Run an MoE layer on a parallel layout and compare it with the dense reference.

Tolerance: fp32 on CPU. The parallel layer sums the same products in another order
(batched GEMMs instead of per-token products, partial sums over etp and ep, index_add
instead of a Python sum). The rounding error of a reordered sum scales with the size of
its terms, not of its result (gradients sum terms that cancel), and the largest element of
a tensor bounds its terms' scale: ``assert_close_to_reference`` allows a multiple of
u · sqrt(n) · max|expected|, with n (``N``) the layer's chain of sums: the router over H,
the experts' two GEMMs (H, then the ffn width), the top-k combine, forward and back, then
the tokens of every dp rank for a weight gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _moe_reference import FullWeights, full_weights, reference_moe
from torch import Tensor

from mega_moe import MoEConfig, MoELayer, expert_shard, gather_expert_weight
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import assert_close_to_reference, rank_device
from mega_tp_layers import Normal, shard_spec, shard_tensor

SEED = 5
H, S, B = 16, 4, 2
FFN_MAX, TOP_K_MAX, DP_MAX = 64, 4, 4  # the largest in the tests that use this harness
N = 2 * (2 * H + FFN_MAX + TOP_K_MAX) + DP_MAX * S * B
INIT = Normal(0.3)  # O(1) activations, well-separated router logits


def close(actual: Tensor, expected: Tensor, what: str) -> None:
    """``actual`` within the rounding bound of ``expected`` (see the module doc)."""
    assert_close_to_reference(actual.float(), expected.float(), reduction_length=N, name=what)


def _full_of(name: str, full: FullWeights, grad: bool) -> Tensor:
    table = {
        "router.weight": full.router,
        "shared_experts.weight1": full.shared1,
        "shared_experts.weight2": full.shared2,
        "shared_experts.gate_weight": full.gate,
    }
    if name in table:
        t = table[name]
    else:
        t = full.w1 if name.endswith("weight1") else full.w2
    assert t is not None, name
    if grad:
        assert t.grad is not None, name
        return t.grad
    return t.detach()


def local_part(name: str, param: Tensor, full: FullWeights, grad: bool = False) -> Tensor:
    """This rank's part of the full weight (or gradient) named ``name``."""
    whole = _full_of(name, full, grad)
    shard = expert_shard(param)
    if shard is not None:
        block = whole[shard.first_expert : shard.first_expert + shard.num_local]
        block = block.chunk(shard.etp, dim=shard.etp_dim + 1)[shard.etp_rank]
        return block if shard.stacked else block[0]
    spec = shard_spec(param)
    assert spec is not None, name
    return shard_tensor(whole, spec)


def build(
    cfg: MoEConfig, groups: Any, sp: bool, aux_global: bool, bias: list[float] | None
) -> tuple[MoELayer, FullWeights]:
    """The parallel layer and the full weights of the same layer built in one process."""
    dev = rank_device()
    layer = MoELayer(
        H,
        cfg,
        ep_group=groups.ep,
        etp_group=groups.etp,
        tp_group=groups.tp,
        sequence_parallel=sp,
        aux_loss_group=groups.tp_dp_cp if aux_global else None,
        init_method=INIT,
        seed=SEED,
        name="moe",
        device=dev,
    )
    solo = MoELayer(H, cfg, init_method=INIT, seed=SEED, name="moe")
    for m in (layer, solo):
        if bias is not None:
            assert m.router.expert_bias is not None
            m.router.expert_bias.copy_(torch.tensor(bias))
    full = full_weights(solo)
    for name, p in layer.named_parameters():  # DESIGN rule 2: exactly the slice, bitwise
        assert torch.equal(p.detach().cpu(), local_part(name, p, full)), name
        if expert_shard(p) is not None:
            whole = gather_expert_weight(p, groups.ep, groups.etp)
            shard = expert_shard(p)
            assert shard is not None
            expected = _full_of(name, full, False)
            if not shard.stacked:
                expected = expected[shard.first_expert]
            assert torch.equal(whole.cpu(), expected), name
    return layer, full


def run_case(
    cfg: MoEConfig,
    *,
    ep: int = 1,
    etp: int = 1,
    tp: int = 1,
    sp: bool = False,
    aux_global: bool = False,
    bias: list[float] | None = None,
    uneven: bool = False,
) -> dict[str, Any]:
    """Forward + backward on this rank; assert everything equals the reference.

    ``uneven``: data-parallel replica i holds ``S + 2 i`` positions (uneven token counts).
    """
    groups = init_process_groups(ParallelConfig(tp=tp, ep=ep, etp=etp))
    dev = rank_device()
    layer, full = build(cfg, groups, sp, aux_global, bias)
    dp, dp_rank, tp_rank = groups.size("dp"), groups.rank("dp"), groups.rank("tp")
    lengths = [S + 2 * i if uneven else S for i in range(dp)]
    xs = [torch.randn(n, B, H) for n in lengths]
    cots = [torch.randn(n, B, H) for n in lengths]

    chunks = [xs[i].clone().requires_grad_() for i in range(dp)]
    ref = reference_moe(chunks, full, cfg, global_aux=aux_global)
    loss = sum(((o * c).sum() for o, c in zip(ref.outputs, cots, strict=True)), torch.zeros(()))
    (loss + ref.aux + ref.seq_aux + ref.z).backward()

    def mine(t: Tensor) -> Tensor:  # what this rank holds of a replica's [s, b, h]
        return t.chunk(tp, dim=0)[tp_rank] if sp else t

    x = mine(xs[dp_rank]).to(dev).requires_grad_()
    out = layer(x)
    stats = layer.last_stats
    assert stats is not None
    ((out * mine(cots[dp_rank]).to(dev)).sum() + stats.loss).backward()

    close(out, mine(ref.outputs[dp_rank]), "output")
    grad = chunks[dp_rank].grad
    assert x.grad is not None and grad is not None
    close(x.grad, mine(grad), "input grad")
    for what, share, expected in (
        ("aux", stats.aux_loss, ref.aux),
        ("seq aux", stats.seq_aux_loss, ref.seq_aux),
        ("z", stats.z_loss, ref.z),
    ):
        total = share.detach().clone()
        dist.all_reduce(total)  # the shares of all ranks add up to the loss
        close(total, expected, f"{what} loss")
    for name, p in layer.named_parameters():
        assert p.grad is not None, name
        g = p.grad.clone()
        dist.all_reduce(g, group=groups.edp if expert_shard(p) is not None else groups.dp)
        close(g, local_part(name, p, full, grad=True), f"{name} grad")
    if tp == 1:  # the router's kept (token, expert) pairs are the reference drop rule's
        with torch.no_grad():
            routing = layer.router(x)
        pairs = routing.routing_map.nonzero().tolist()
        assert {(t, e) for t, e in pairs} == ref.kept[dp_rank]
        assert int(stats.num_dropped) == ref.dropped[dp_rank]
    return {"dropped": int(stats.num_dropped), "kept": stats.tokens_per_expert.tolist()}
