"""An MoE layer compiles whole (``fullgraph=True``: no graph break) on one rank, dropless,
and computes what the eager layer computes; the dispatch keeps its counts on the device.

Tolerance: fp32 on CPU. The compiler fuses and reorders the same arithmetic (softmax,
the router's reductions, SwiGLU), so outputs and gradients agree to a few ulps of their
largest element: ``1e-5 * max|eager|`` (about 80 ulps) absolute, ``1e-5`` relative.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from mega_moe import MoEConfig, MoELayer
from mega_moe.config import RouterConfig
from mega_moe.dispatcher import AllToAllDispatcher

H, S, B = 16, 8, 2


def _close(actual: Tensor, expected: Tensor, what: str) -> None:
    atol = 1e-5 * float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


def _layer(router: dict[str, object], shared: int) -> MoELayer:
    config = MoEConfig(
        router=RouterConfig(num_experts=4, top_k=2, **router),  # type: ignore[arg-type]
        ffn_hidden_size=32,
        shared_ffn_size=shared,
    )
    return MoELayer(H, config, seed=3)


def _run(layer: torch.nn.Module, x: Tensor) -> tuple[Tensor, Tensor, list[Tensor]]:
    x = x.clone().requires_grad_(True)
    y = layer(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    assert x.grad is not None
    grads = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
    layer.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


@pytest.mark.parametrize(
    ("router", "shared"),
    [({}, 0), ({"score_function": "sigmoid", "expert_bias": True}, 0), ({}, 24)],
    ids=["softmax", "sigmoid-bias", "shared"],
)
def test_moe_layer_compiles_without_graph_breaks(router: dict[str, object], shared: int) -> None:
    torch._dynamo.reset()
    layer = _layer(router, shared)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(0))
    eager = _run(layer, x)
    compiled = _run(torch.compile(layer, fullgraph=True), x)  # raises on a graph break
    _close(compiled[0], eager[0], "output")
    _close(compiled[1], eager[1], "input grad")
    assert len(compiled[2]) == len(eager[2]) > 0
    for i, (c, e) in enumerate(zip(compiled[2], eager[2], strict=True)):
        _close(c, e, f"parameter grad {i}")
    torch._dynamo.reset()


def test_one_rank_dispatch_keeps_counts_on_the_device() -> None:
    """At ep 1 · etp 1 nothing travels: the counts stay a device tensor (no host read)."""
    layer = _layer({}, 0)
    x = torch.randn(S * B, H)
    routing = layer.router(x)
    dispatched = AllToAllDispatcher(4, ep_group=None, etp_group=None).dispatch(x, routing)
    assert isinstance(dispatched.counts, Tensor)
    assert dispatched.counts.tolist() == routing.routing_map.sum(dim=0).tolist()
    assert dispatched.tokens.shape == (S * B * 2, H)


def test_compiled_fp32_takes_the_loop_where_the_shape_function_wants_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.11's shape function of ``torch._grouped_mm`` demands bf16, so compiling an fp32
    layer on CPU failed there (the GPU machine's CPU, 2026-12-07) though its eager CPU kernel
    takes fp32: on such a torch the compiled layer is given the loop of GEMMs instead."""
    import mega_moe._gemm as gemm

    x, w = torch.randn(16, 16), torch.randn(2, 16, 16)
    monkeypatch.setattr(gemm, "_COMPILED_FP32_GROUPED_MM", False)
    assert gemm.grouped_mm_available(x, w)  # eager: the CPU kernel takes fp32

    def choice(x: Tensor, w: Tensor) -> Tensor:
        return torch.ones(1) if gemm.grouped_mm_available(x, w) else torch.zeros(1)

    torch._dynamo.reset()
    assert torch.compile(choice, fullgraph=True)(x, w).item() == 0.0
    monkeypatch.setattr(gemm, "_COMPILED_FP32_GROUPED_MM", True)
    torch._dynamo.reset()
    assert torch.compile(choice, fullgraph=True)(x, w).item() == 1.0
