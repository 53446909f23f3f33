"""FLOPs per token count the router, the top-k experts and the shared experts only."""

from __future__ import annotations

from mega_moe import MoEConfig, MoELayer, RouterConfig, moe_activated_params, moe_flops_per_token


def test_counts_only_activated_experts() -> None:
    cfg = MoEConfig(
        router=RouterConfig(num_experts=8, top_k=2), ffn_hidden_size=32, shared_ffn_size=16
    )
    # router 16*8 + 2 experts * (3 * 16 * 32) + shared 3 * 16 * 16
    assert moe_activated_params(16, cfg) == 128 + 3072 + 768
    assert moe_flops_per_token(16, cfg) == 2.0 * 3968
    assert moe_flops_per_token(16, cfg, backward=True) == 6.0 * 3968


def test_matches_the_layer_parameters() -> None:
    for activation in ("swiglu", "gelu"):
        cfg = MoEConfig(
            router=RouterConfig(num_experts=8, top_k=3),
            ffn_hidden_size=24,
            activation=activation,
            shared_ffn_size=8,
        )  # type: ignore[arg-type]
        layer = MoELayer(16, cfg)
        assert layer.shared_experts is not None
        experts = sum(p.numel() for p in layer.experts.parameters())
        shared = sum(p.numel() for p in layer.shared_experts.parameters())
        active = layer.router.weight.numel() + experts * 3 // 8 + shared
        assert moe_activated_params(16, cfg) == active


def test_bench_sizes() -> None:
    """64 experts, top-8, h 2048, ffn 1024, SwiGLU: 2 * (131072 + 8 * 6291456) per token."""
    cfg = MoEConfig(router=RouterConfig(num_experts=64, top_k=8), ffn_hidden_size=1024)
    assert moe_flops_per_token(2048, cfg) == 2.0 * (2048 * 64 + 8 * 3 * 2048 * 1024)
