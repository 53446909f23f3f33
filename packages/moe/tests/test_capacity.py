"""Capacity factor: the dropped (token, expert) choices are exactly the reference rule's.

The reference keeps, per expert, the ``ceil(factor * tokens * k / E)`` choices with the
highest weights (``"probs"``) or the first in token order (``"position"``), from each
rank's own tokens; the harness compares the router's kept pairs and the dropped count
with it, and the layer's outputs and gradients with the reference that drops the same.
Padding to capacity must not change any of it. Tolerance: see _moe_harness.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _moe_harness import run_case

from mega_moe import MoEConfig, RouterConfig
from mega_parallel_grid.testing import DistPool

CASES = [
    (ep, policy, dispatcher, pad)
    for ep in (1, 2)
    for policy in ("probs", "position")
    for dispatcher, pad in (("alltoall", False), ("alltoall", True), ("allgather", False))
]


@pytest.mark.parametrize(("ep", "policy", "dispatcher", "pad"), CASES)
def test_dropped_tokens_follow_the_reference_rule(
    dist_pool: DistPool, ep: int, policy: str, dispatcher: str, pad: bool
) -> None:
    router = RouterConfig(
        num_experts=8,
        top_k=2,
        capacity_factor=0.5,
        drop_policy=policy,  # type: ignore[arg-type]
        pad_to_capacity=pad,
        aux_loss_coeff=0.1,
    )
    cfg = MoEConfig(router=router, ffn_hidden_size=32, dispatcher=dispatcher)  # type: ignore[arg-type]
    results = dist_pool.run(run_case, ep, args=(cfg,), kwargs={"ep": ep})
    assert all(r["dropped"] > 0 for r in results)  # the factor is small enough to drop


def test_capacity_with_expert_tensor_parallel(dist_pool: DistPool) -> None:
    router = RouterConfig(num_experts=8, top_k=2, capacity_factor=0.75, pad_to_capacity=True)
    cfg = MoEConfig(router=router, ffn_hidden_size=32, experts="sequential")
    dist_pool.run(run_case, 4, args=(cfg,), kwargs={"ep": 2, "etp": 2})


def _padded_layer() -> Any:
    """An ep 2 MoE layer with the padded all-to-all dispatcher (8 experts, top 2)."""
    from mega_moe import MoELayer
    from mega_parallel_grid import ParallelConfig, init_process_groups
    from mega_parallel_grid.testing import rank_device

    groups = init_process_groups(ParallelConfig(ep=2))
    router = RouterConfig(num_experts=8, top_k=2, capacity_factor=1.0, pad_to_capacity=True)
    cfg = MoEConfig(router=router, ffn_hidden_size=32)
    return MoELayer(
        16, cfg, ep_group=groups.ep, etp_group=groups.etp, tp_group=groups.tp,
        device=rank_device(),
    )  # fmt: skip


def _no_host_sync_when_padded() -> int:
    from mega_parallel_grid.testing import rank_device

    dev = rank_device()
    layer = _padded_layer()
    x = torch.randn(6, 2, 16, device=dev, requires_grad=True)  # [s, b, h]
    layer(x).sum().backward()  # warm-up outside the check

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("host sync in the padded all-to-all dispatch")

    dispatched = layer.dispatcher.dispatch
    calls = []

    def checked(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        saved = (torch.Tensor.tolist, torch.Tensor.item)
        torch.Tensor.tolist, torch.Tensor.item = forbidden, forbidden  # type: ignore[method-assign,assignment]
        try:
            return dispatched(*args, **kwargs)
        finally:
            torch.Tensor.tolist, torch.Tensor.item = saved  # type: ignore[method-assign]

    layer.dispatcher.dispatch = checked  # type: ignore[method-assign]
    layer(x).sum().backward()
    return len(calls)


def test_padded_all_to_all_needs_no_host_sync(dist_pool: DistPool) -> None:
    assert dist_pool.run(_no_host_sync_when_padded, 2) == [1, 1]


def _uneven_padded() -> str:
    from mega_parallel_grid.testing import rank_device

    dev = rank_device()
    layer = _padded_layer()
    s = 6 if torch.distributed.get_rank() == 0 else 4  # 12 vs 8 tokens
    try:
        layer(torch.randn(s, 2, 16, device=dev))
    except ValueError as exc:
        return str(exc)
    return "no error raised"


def test_padded_all_to_all_with_unequal_token_counts_is_one_sentence(
    dist_pool: DistPool,
) -> None:
    for message in dist_pool.run(_uneven_padded, 2):  # every rank, no hang
        assert "pad_to_capacity needs every ep rank to route the same number of tokens" in message
        assert "[12, 8]" in message
