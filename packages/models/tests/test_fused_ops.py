"""``GPTConfig.fused_elementwise``: the activation and RoPE as compiled regions compute what
the eager ops do, and a whole-model compile traces them in place instead of nesting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mega_models import GPTConfig, GPTModel, fused_ops, model_config
from mega_models.fused_ops import activation, run_fused
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, solo_groups

B, S = 2, 16


def _mla(**changes: object) -> GPTConfig:
    return model_config("tiny").replace(
        attention="mla", q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, num_query_groups=8, **changes,
    )  # fmt: skip


def _loss_and_grads(config: GPTConfig, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    net = GPTModel(config, solo_groups(), seed=5)
    loss = net(tokens, tokens.roll(-1, dims=1)).mean()
    loss.backward()
    out = {"loss": loss.detach()}
    out.update({n: p.grad for n, p in net.named_parameters() if p.grad is not None})
    return out


def _check_model(config: GPTConfig) -> None:
    tokens = torch.randint(0, config.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    plain = _loss_and_grads(config, tokens)
    fused_ops._compiled.cache_clear()
    fused = _loss_and_grads(config.replace(fused_elementwise=True), tokens)
    assert fused_ops._compiled.cache_info().currsize == 2  # the activation and RoPE regions
    assert fused.keys() == plain.keys()
    # the regions round each element once where the eager ops may round between ops; that
    # difference passes through every later layer's sums: over the tokens (weight
    # gradients), the hidden and ffn widths (activations), and the loss's vocabulary
    c = config
    n = c.num_layers * (B * S + c.hidden_size + c.ffn_size) + c.vocab_size
    for name, expected in plain.items():
        assert_close_to_reference(fused[name], expected, reduction_length=n, name=name)


@pytest.mark.parametrize(
    "config", [model_config("tiny"), _mla(activation="relu2")], ids=["swiglu-rope", "mla-relu2"]
)
def test_fused_model_matches_eager(dist_pool: DistPool, config: GPTConfig) -> None:
    dist_pool.run(_check_model, 1, args=(config,))


@pytest.mark.parametrize("kind", ["swiglu", "relu2", "gelu"])
def test_activation_is_the_plain_ops(kind: str) -> None:
    y = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(1))
    if kind == "swiglu":
        expected = F.silu(y[..., 0::2]) * y[..., 1::2]
    elif kind == "relu2":
        expected = F.relu(y) ** 2
    else:
        expected = F.gelu(y, approximate="tanh")
    assert torch.equal(activation(y, kind), expected)


def test_inside_a_compiled_model_nothing_is_compiled_twice() -> None:
    fused_ops._compiled.cache_clear()

    def step(y: torch.Tensor) -> torch.Tensor:
        return run_fused(True, activation, y, "swiglu") * 2

    y = torch.randn(4, 8)
    out = torch.compile(step, fullgraph=True)(y)
    assert fused_ops._compiled.cache_info().currsize == 0  # traced into step's graph
    assert_close_to_reference(out, step(y), reduction_length=1, name="compiled step")
    assert fused_ops._compiled.cache_info().currsize == 1  # eager: its own region


def test_default_fuses_on_cuda_only() -> None:
    """None (the default) fuses CUDA tensors; a CPU run compiles nothing."""
    fused_ops._compiled.cache_clear()
    y = torch.randn(4, 8)
    assert model_config("tiny").fused_elementwise is None
    assert torch.equal(run_fused(None, activation, y, "swiglu"), activation(y, "swiglu"))
    assert fused_ops._compiled.cache_info().currsize == 0
