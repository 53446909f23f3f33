"""Multi-head latent attention (DeepSeek-V2/V3) and an explicit head width (kv_channels).

The GPT contract (``test_gpt_contract._contract``: parameters, per-token losses and every
gradient of the parallel model equal the single-process model's, fp32, the rounding bound
of the model's chain of sums) on an MLA model at tp 2, tp 2 and 4 with sequence parallel,
cp 2 ring and all-gather, and the plain-q variant; MLA against transformers'
``DeepseekV3Attention`` (YaRN, interleaved rope weights permuted on the way in);
context-parallel attention with a value head narrower than the qk head; the exact
parameter and FLOP counts; each bad configuration's sentence.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_gpt_contract import _contract

from mega_models import GPTConfig, GPTModel, matmul_params, model_config, spec_for
from mega_models.context_parallel import context_parallel_attention, zigzag_split
from mega_models.flops import forward_flops_per_token
from mega_models.mla import MultiLatentAttention, cudnn_takes_narrow_values, latent_sdpa
from mega_models.rope import rope_for, yarn_inv_freq
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device, solo_groups

# tiny's dims (hidden 64, 8 heads, 8 layers); qk head 8 + 4 = 12 wider than the value head 6
MLA: dict[str, Any] = {
    "attention": "mla", "num_query_groups": None, "q_lora_rank": 32, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
}  # fmt: skip
PLAIN_Q: dict[str, Any] = {**MLA, "q_lora_rank": None}


@pytest.mark.parametrize(
    ("tp", "cp", "sp", "method", "changes"),
    [
        (2, 1, False, "ring", MLA),
        (2, 1, True, "ring", MLA),
        (4, 1, True, "ring", MLA),
        (1, 2, False, "ring", MLA),
        (1, 2, False, "all_gather", MLA),
        (2, 2, True, "all_gather", MLA),
        (2, 1, True, "ring", PLAIN_Q),
        (2, 1, False, "ring", {"kv_channels": 16}),  # 8 heads of 16 on a 64-wide stream
    ],
    ids=[
        "tp2",
        "tp2-sp",
        "tp4-sp",
        "cp2-ring",
        "cp2-all_gather",
        "tp2-cp2-sp-all_gather",
        "plain-q-tp2-sp",
        "kv16-tp2",
    ],
)
def test_mla_layouts_match_single_process(
    dist_pool: DistPool, tp: int, cp: int, sp: bool, method: str, changes: dict[str, object]
) -> None:
    dist_pool.run(_contract, tp * cp, args=(tp, cp, sp, method, changes))


def _check_cp_unequal_dims(method: str) -> None:
    """cp 2 attention with d_v (6) < d_qk (12) and a non-default scale equals full SDPA."""
    cp, rank, dev = dist.get_world_size(), dist.get_rank(), rank_device()
    b, n, s, d, dv, scale = 2, 4, 16, 12, 6, 0.3
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(b, n, s, d, generator=gen), torch.randn(b, n, s, d, generator=gen)
    v, grad_out = torch.randn(b, n, s, dv, generator=gen), torch.randn(b, n, s, dv, generator=gen)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, scale=scale)
    ref.backward(grad_out)
    local = [zigzag_split(t, cp, rank, dim=2).to(dev).requires_grad_() for t in (q, k, v)]
    world: dist.ProcessGroup = dist.group.WORLD  # type: ignore[assignment]
    out = context_parallel_attention(*local, cp_group=world, seq_len=s, method=method, scale=scale)
    out.backward(zigzag_split(grad_out, cp, rank, dim=2).to(dev))
    n_sums = 2 * (d + 2 * s)
    assert out.shape == (b, n, s // cp, dv)
    assert_close_to_reference(
        out, zigzag_split(ref, cp, rank, dim=2), reduction_length=n_sums, name=f"{method} output"
    )
    for what, mine, whole in zip("qkv", local, full, strict=True):
        assert mine.grad is not None and whole.grad is not None
        assert_close_to_reference(
            mine.grad, zigzag_split(whole.grad, cp, rank, dim=2), reduction_length=n_sums,
            name=f"{method}: {what} grad",
        )  # fmt: skip


@pytest.mark.parametrize("method", ["ring", "all_gather"])
def test_cp_attention_with_value_head_narrower_than_qk(dist_pool: DistPool, method: str) -> None:
    dist_pool.run(_check_cp_unequal_dims, 2, args=(method,))


def test_latent_sdpa_with_unequal_head_dims_is_plain_attention() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 10, d, generator=gen) for d in (12, 12, 6))
    scores = (q @ k.transpose(-1, -2)) * 0.25
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    expected = scores.softmax(-1) @ v
    assert_close_to_reference(
        latent_sdpa(q, k, v, scale=0.25), expected, reduction_length=12 + 10, name="sdpa"
    )


def test_compiled_latent_sdpa_logs_no_error_and_matches_eager(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Inductor's attention pattern matcher failed (and logged a traceback at ERROR) on the
    # unpadded unequal dims; compiled, the values are padded as on CUDA
    # the layer's layout: [s, b, n, d] projections viewed as [b, n, s, d]
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(16, 2, 3, d, generator=gen, requires_grad=True) for d in (12, 12, 8))

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return latent_sdpa(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), scale=0.3)

    torch._dynamo.reset()
    with caplog.at_level(logging.ERROR, logger="torch"):
        out = torch.compile(f, backend="inductor", fullgraph=True)(q, k, v)
        out.sum().backward()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[0]
    compiled_grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    eager = f(q, k, v)
    eager.sum().backward()
    assert_close_to_reference(out, eager, reduction_length=12 + 16, name="compiled sdpa")
    for name, got, t in zip("qkv", compiled_grads, (q, k, v), strict=True):
        assert got is not None and t.grad is not None
        assert_close_to_reference(got, t.grad, reduction_length=12 + 16, name=f"d{name}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the padded flash path needs CUDA")
def test_latent_sdpa_padded_on_cuda_matches_fp32() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 128, d, generator=gen).cuda() for d in (192, 192, 128))
    ref = latent_sdpa(q, k, v, scale=192**-0.5)
    half = latent_sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale=192**-0.5)
    assert half.shape == ref.shape
    torch.testing.assert_close(half.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and cudnn_takes_narrow_values(torch.device("cuda"))),
    reason="cuDNN's attention on a narrower value head needs sm90+",
)
@pytest.mark.parametrize("compiled", [False, True])
def test_latent_sdpa_cudnn_narrow_values_match_the_padded_path(compiled: bool) -> None:
    """cuDNN on the unequal dims against the values zero-padded to the qk dim (FlashAttention
    or cuDNN on equal dims), bf16, forward and the three input gradients. Both are the same
    attention with fp32 accumulation and bf16 inputs and outputs; they differ in where they
    round (the probabilities before the PV product, the outputs), a few bf16 units (2^-8
    relative) of each tensor's largest magnitude: bound 8 units."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(3)
    shapes = [(2, 4, 256, d) for d in (192, 192, 128)]
    q, k, v = (torch.randn(s, generator=gen).cuda().bfloat16().requires_grad_() for s in shapes)
    dy = torch.randn(2, 4, 256, 128, generator=gen).cuda().bfloat16()
    fn = torch.compile(latent_sdpa, fullgraph=True) if compiled else latent_sdpa
    torch._dynamo.reset()
    narrow = fn(q, k, v, scale=192**-0.5)
    narrow_grads = torch.autograd.grad(narrow, (q, k, v), dy)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        padded_v = torch.nn.functional.pad(v, (0, 64))
        padded = torch.nn.functional.scaled_dot_product_attention(
            q, k, padded_v, is_causal=True, scale=192**-0.5
        )[..., :128]
    padded_grads = torch.autograd.grad(padded, (q, k, v), dy)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (narrow, *narrow_grads),
                               (padded, *padded_grads), strict=True):  # fmt: skip
        bound = 8 * 2**-8 * float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), atol=bound, rtol=0, msg=name)


def _interleaved_to_halves(weight: torch.Tensor, per_head: int, nope: int) -> torch.Tensor:
    """HF DeepSeek rope rows (pairs 2i, 2i+1) -> mega's rotate-half rows (evens, then odds)."""
    w = weight.view(-1, per_head, weight.shape[-1])
    rope = w[:, nope:]
    rope = torch.cat([rope[:, 0::2], rope[:, 1::2]], dim=1)
    return torch.cat([w[:, :nope], rope], dim=1).reshape(weight.shape)


def _hf_attention_check(q_lora: int | None, mscale: float) -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    yarn = {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": 1.0}  # fmt: skip
    hf = DeepseekV3Config(
        hidden_size=64, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=q_lora,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **yarn},
    )  # fmt: skip
    hf._attn_implementation = "sdpa"
    assert hf.rope_interleave
    torch.manual_seed(0)
    ref = DeepseekV3Attention(hf, 0).eval()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    c = GPTConfig(
        hidden_size=64, num_attention_heads=8, num_layers=2, max_seq_len=64, norm_eps=1e-6,
        **{**MLA, "q_lora_rank": q_lora}, rope_scaling_factor=4.0, rope_original_max_position=16,
        rope_mscale=mscale, rope_mscale_all_dim=1.0,
    )  # fmt: skip
    groups = solo_groups()
    mine = MultiLatentAttention(c, tp_group=groups.tp, cp_group=groups.cp, sequence_parallel=False)
    with torch.no_grad():
        if q_lora is None:
            mine.q_up.weight.copy_(_interleaved_to_halves(ref.q_proj.weight, 12, 8))
        else:
            assert mine.q_down is not None and mine.q_norm is not None
            mine.q_down.weight.copy_(ref.q_a_proj.weight)
            mine.q_norm.weight.copy_(ref.q_a_layernorm.weight)
            mine.q_up.weight.copy_(_interleaved_to_halves(ref.q_b_proj.weight, 12, 8))
        mine.kv_down.weight.copy_(_interleaved_to_halves(ref.kv_a_proj_with_mqa.weight, 20, 16))
        mine.kv_norm.weight.copy_(ref.kv_a_layernorm.weight)
        mine.kv_up.weight.copy_(ref.kv_b_proj.weight)
        mine.proj.weight.copy_(ref.o_proj.weight)
    s, b = 40, 2  # longer than the original 16 positions: YaRN's interpolated band matters
    x = torch.randn(b, s, 64, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(s)
    tables = rope_for(c, positions, torch.float32)
    assert tables is not None
    hf_cos, hf_sin = DeepseekV3RotaryEmbedding(hf)(x, positions[None].expand(b, s))
    assert_close_to_reference(tables[0][:, 0, 0], hf_cos[0], reduction_length=1, name="cos")
    assert_close_to_reference(tables[1][:, 0, 0], hf_sin[0], reduction_length=1, name="sin")
    # d 4, theta 1e4: frequencies 1 and 1/100; the fast one turns 16/2pi > beta_slow times
    # over the original 16 positions, so only the slow one is interpolated (by the factor 4)
    inv = yarn_inv_freq(4, 10000.0, 4.0, 16)
    torch.testing.assert_close(inv, torch.tensor([1.0, 0.01 / 4]), rtol=1e-6, atol=0)
    assert math.isclose(c.softmax_scale, ref.scaling, rel_tol=1e-12)
    assert c.softmax_scale > 12**-0.5  # mscale(4, 1)^2 = (0.1 ln 4 + 1)^2
    expected, _ = ref(x, (hf_cos, hf_sin), None)
    out = mine(x.transpose(0, 1), tables, s).transpose(0, 1)  # [b, s, h] <-> [s, b, h]
    assert_close_to_reference(out, expected, reduction_length=4 * 64 + s, name="output")


@pytest.mark.parametrize(
    ("q_lora", "mscale"), [(32, 1.0), (None, 0.707)], ids=["q-lora", "plain-q"]
)
def test_mla_matches_transformers_deepseek_v3_attention_with_yarn(
    dist_pool: DistPool, q_lora: int | None, mscale: float
) -> None:
    dist_pool.run(_hf_attention_check, 1, args=(q_lora, mscale))


def _count_params(config: GPTConfig) -> int:
    model = GPTModel(config, solo_groups(), seed=1, device="meta")
    return sum(p.numel() for p in model.parameters())


def _param_count_check() -> None:
    for q_lora in (32, None):
        c = GPTConfig(
            vocab_size=100, hidden_size=64, num_layers=2, num_attention_heads=8,
            ffn_hidden_size=96, **{**MLA, "q_lora_rank": q_lora},
        )  # fmt: skip
        h, n, layers = 64, 8, 2
        q = 32 * h + 32 * n * 12 if q_lora else h * n * 12  # q down + up, or one projection
        attention = q + h * (16 + 4) + 16 * n * (8 + 6) + n * 6 * h  # kv down, kv up, out
        mlp = 3 * h * 96
        assert matmul_params(c) == layers * (attention + mlp) + h * 100
        latent_norms = 16 + (32 if q_lora else 0)
        norms = layers * (2 * h + latent_norms) + h
        assert spec_for(c).total_params(c) == matmul_params(c) + 100 * h + norms
        assert spec_for(c).total_params(c) == _count_params(c)
        seq = 32
        attn_flops = 2 * seq * n * (12 + 6) * layers  # QK^T over d_qk, AV over d_v
        assert forward_flops_per_token(c, seq) == 2 * matmul_params(c) + attn_flops


def test_mla_parameter_and_flop_counts_are_exact(dist_pool: DistPool) -> None:
    dist_pool.run(_param_count_check, 1)


def test_explicit_head_width() -> None:
    c = model_config("tiny").replace(kv_channels=16)
    assert (c.head_dim, c.v_dim, c.rope_dim) == (16, 16, 16)
    assert model_config("tiny").head_dim == 8
    odd = GPTConfig(hidden_size=60, num_attention_heads=8, kv_channels=8)  # 60 / 8 needs it
    assert odd.head_dim == 8
    m = GPTConfig(**MLA)  # type: ignore[arg-type]
    assert (m.head_dim, m.v_dim, m.rope_dim) == (12, 6, 4)


def _error(**changes: object) -> str:
    with pytest.raises(ValueError) as err:
        GPTConfig(**changes)  # type: ignore[arg-type]
    text = str(err.value)
    assert text.count(". ") == 0 and "\n" not in text, text  # one sentence
    return text


def test_bad_attention_settings_fail_in_one_sentence() -> None:
    assert _error(attention="gqa") == "attention ('gqa') must be 'mha' or 'mla'"
    assert _error(attention="mla", kv_lora_rank=16) == (
        "attention 'mla' needs qk_nope_head_dim, qk_rope_head_dim, v_head_dim; set them "
        "(DeepSeek-V3: kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128)"
    )
    assert _error(kv_lora_rank=16) == (
        "kv_lora_rank is a setting of multi-head latent attention; set attention = 'mla' or "
        "leave it unset"
    )
    assert _error(**{**MLA, "v_head_dim": 0}) == "v_head_dim (0) must be a positive integer"
    assert _error(**{**MLA, "num_query_groups": 4}) == (
        "MLA gives every query head its own key and value, so num_query_groups (4) must be "
        "unset or num_attention_heads (8)"
    )
    bias = (
        "attention 'mla' has no biases on its projections (and add_bias would put them "
        "there); set add_bias and qkv_bias to false"
    )
    assert _error(**MLA, add_bias=True) == bias
    assert _error(**MLA, qkv_bias=True) == bias
    assert _error(**MLA, qk_norm=True) == (
        "attention 'mla' normalises its q and kv latents, not per-head q and k; set qk_norm "
        "to false"
    )
    assert _error(**MLA, position="learned") == (
        "attention 'mla' rotates its decoupled rope key, so position ('learned') must be 'rope'"
    )
    assert _error(**{**MLA, "qk_rope_head_dim": 5}) == (
        "the rope head dim (5) must be even for rope; change hidden_size, heads, kv_channels "
        "or qk_rope_head_dim"
    )
    assert _error(**MLA, kv_channels=16).startswith("kv_channels (16) sets the head width")
    assert _error(kv_channels=0) == "kv_channels (0) must be a positive integer"
    assert _error(hidden_size=60) == (
        "hidden_size (60) is not divisible by num_attention_heads (8); choose a multiple of "
        "the head count, or set kv_channels"
    )


def test_relu2_experts_fail_in_one_sentence() -> None:  # mega-moe's experts have no relu2
    assert _error(num_experts=4, activation="relu2") == (
        "invalid MoE setting: activation 'relu2' is built for dense MLPs only; MoE experts "
        "take 'swiglu' or 'gelu', so choose one of them or set num_experts to 0"
    )


def test_bad_yarn_settings_fail_in_one_sentence() -> None:
    assert _error(rope_scaling_factor=4.0) == (
        "rope_scaling_factor (4.0) is DeepSeek's YaRN scaling, built for attention 'mla'; set "
        "attention = 'mla' or leave it unset"
    )
    assert _error(**MLA, rope_scaling_factor=4.0) == (
        "rope_scaling_factor (4.0) needs rope_original_max_position, the context length "
        "before extension (DeepSeek-V3: 4096)"
    )
    yarn = {**MLA, "rope_scaling_factor": 4.0, "rope_original_max_position": 16}
    assert _error(**{**yarn, "rope_scaling_factor": 0.5}) == (
        "rope_scaling_factor (0.5) must be a number >= 1, or None"
    )
    assert _error(**yarn, rope_beta_fast=1.0) == (
        "YaRN needs rope_beta_fast (1.0) > rope_beta_slow (1.0) > 0 (DeepSeek-V3: 32 and 1)"
    )
    assert _error(**yarn, rope_mscale=-1.0) == "rope_mscale (-1.0) must be >= 0"
    assert _error(rope_original_max_position=16) == (
        "rope_original_max_position (16) is a YaRN setting; set rope_scaling_factor too, or "
        "leave it unset"
    )


def _tp_error() -> None:
    from mega_parallel_grid import ParallelConfig, init_process_groups

    groups = init_process_groups(ParallelConfig(tp=2))
    c = model_config("tiny").replace(**{**MLA, "num_attention_heads": 3, "hidden_size": 66})
    with pytest.raises(
        ValueError, match=r"^num_attention_heads \(3\) is not divisible by tp \(2\)"
    ):
        GPTModel(c, groups, device="meta")


def test_mla_heads_not_divisible_by_tp_fail_in_one_sentence(dist_pool: DistPool) -> None:
    dist_pool.run(_tp_error, 2)


# FP8 (emulated exactly on CPU): GEMM operands rounded to e4m3 (<= 2^-4 relative per
# element, random signs), so a loss over 64 tokens moves by well under 3% (as in
# apps/pretrain's test_fp8_train); every MLA GEMM must carry the recipe.
FP8_MLA: dict[str, Any] = {**MLA, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                           "qk_rope_head_dim": 16, "v_head_dim": 16}  # fmt: skip


def _fp8_check(sp: bool) -> None:
    from mega_parallel_grid import ParallelConfig, init_process_groups
    from mega_tp_layers import Fp8Recipe

    tp = dist.get_world_size()
    groups = init_process_groups(ParallelConfig(tp=tp))
    c = model_config("tiny").replace(**FP8_MLA, num_layers=2)
    plain = GPTModel(c, solo_groups(), seed=5)
    fp8 = GPTModel(c, groups, seed=5, fp8=Fp8Recipe(), sequence_parallel=sp)
    attention = fp8.layers["0"].attention
    assert isinstance(attention, MultiLatentAttention)
    gemms = ("q_down", "q_up", "kv_down", "kv_up", "proj")
    assert all(isinstance(getattr(attention, g).fp8, Fp8Recipe) for g in gemms)
    ids = torch.randint(0, c.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    ref = plain(ids[:, :-1], ids[:, 1:]).mean()
    loss = fp8(ids[:, :-1], ids[:, 1:]).mean()
    loss.backward()
    assert abs(float(loss) - float(ref)) < 0.03 * float(ref), (float(loss), float(ref))
    assert attention.kv_down.weight.grad is not None


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, True)], ids=["tp1", "tp2-sp"])
def test_fp8_covers_every_mla_gemm(dist_pool: DistPool, tp: int, sp: bool) -> None:
    dist_pool.run(_fp8_check, tp, args=(sp,))


def _fp8_cache_check(sp: bool) -> None:
    """MLA's GEMMs (column, row and the replicated down-projections) with fp8 weights kept
    across micro-batches compute what they compute without, bit for bit, over two steps."""
    from mega_parallel_grid import ParallelConfig, init_process_groups
    from mega_tp_layers import Fp8Recipe, Fp8WeightCache, invalidate_fp8_weight_caches

    groups = init_process_groups(ParallelConfig(tp=dist.get_world_size()))
    c = model_config("tiny").replace(**FP8_MLA, num_layers=2)
    models = [
        GPTModel(c, groups, seed=5, fp8=Fp8Recipe(cache_weights=cache), sequence_parallel=sp)
        for cache in (False, True)
    ]
    attention = models[1].layers["0"].attention
    assert isinstance(attention, MultiLatentAttention)
    assert all(
        isinstance(getattr(attention, g).fp8_weight, Fp8WeightCache)
        for g in ("q_down", "kv_down", "q_up", "proj")
    )
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, c.vocab_size, (2, 33), generator=gen) for _ in range(4)]
    results: list[list[torch.Tensor]] = [[], []]
    for model, out in zip(models, results, strict=True):
        for step in range(2):
            invalidate_fp8_weight_caches(model.modules())
            for ids in batches[2 * step : 2 * step + 2]:  # two micro-batches a step
                loss = model(ids[:, :-1], ids[:, 1:]).mean()
                loss.backward()
                out.append(loss.detach())
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        out.append(p.grad.clone())
                        p -= 0.1 * p.grad
                        p.grad = None
    assert len(results[0]) == len(results[1])
    for i, (plain, cached) in enumerate(zip(*results, strict=True)):
        assert torch.equal(plain, cached), f"result {i} differs"


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, True)], ids=["tp1", "tp2-sp"])
def test_fp8_weight_cache_on_every_mla_gemm(dist_pool: DistPool, tp: int, sp: bool) -> None:
    dist_pool.run(_fp8_cache_check, tp, args=(sp,))


def test_self_attention_refuses_an_mla_config(dist_pool: DistPool) -> None:
    dist_pool.run(_self_attention_error, 1)


def _self_attention_error() -> None:  # e.g. a hybrid model, whose attention layers are MHA
    from mega_models.attention import SelfAttention

    groups = solo_groups()
    with pytest.raises(ValueError) as err:
        SelfAttention(
            GPTConfig(**MLA), tp_group=groups.tp, cp_group=groups.cp, sequence_parallel=False
        )
    assert str(err.value) == (
        "SelfAttention builds standard attention, but config.attention is 'mla'; build "
        "MultiLatentAttention for it (TransformerLayer picks it), or set attention = 'mha'"
    )


def _per_rank_check() -> None:
    """At tp 2 a rank holds half the MLA's split weights and all its replicated ones."""
    from mega_models.flops import attention_params, replicated_attention_params
    from mega_parallel_grid import ParallelConfig, init_process_groups

    groups = init_process_groups(ParallelConfig(tp=2))
    c = GPTConfig(vocab_size=100, hidden_size=64, num_layers=2, num_attention_heads=8, **MLA)
    model = GPTModel(c, groups, seed=1, device="meta")
    held = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0.attention"))
    whole = replicated_attention_params(c)
    assert whole == 64 * (32 + 16 + 4) + 32 + 16  # q down, kv down, the two latent norms
    latent_norms = 32 + 16
    assert held == (attention_params(c) + latent_norms - whole) // 2 + whole
    one, _ = spec_for(c).params_per_rank(c, ParallelConfig(), 2)
    two, _ = spec_for(c).params_per_rank(c, ParallelConfig(tp=2), 2)
    assert two == int((one - 2 * whole) / 2 + 2 * whole)


def test_mla_replicated_weights_counted_whole_per_rank(dist_pool: DistPool) -> None:
    dist_pool.run(_per_rank_check, 2)


def _recompute_check() -> None:
    """Selective recompute of the MLA core replays its attention-dropout masks exactly."""
    from mega_parallel_grid import ParallelConfig, init_process_groups
    from mega_tp_layers import tp_rng_tracker

    groups = init_process_groups(ParallelConfig(tp=2))
    ids = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(0))
    grads = []
    for recompute, p in (("none", 0.1), ("selective", 0.1), ("none", 0.0)):
        c = model_config("tiny").replace(**MLA, num_layers=2, attention_dropout=p)
        model = GPTModel(
            c, groups, sequence_parallel=True, seed=3, recompute=recompute,  # type: ignore[arg-type]
            rng=tp_rng_tracker(99, groups.tp),
        )  # fmt: skip
        model(ids[:, :-1], ids[:, 1:]).sum().backward()
        grads.append([q.grad.clone() for q in model.parameters() if q.grad is not None])
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(not torch.equal(a, c) for a, c in zip(grads[0], grads[2], strict=True))


def test_mla_selective_recompute_replays_dropout(dist_pool: DistPool) -> None:
    dist_pool.run(_recompute_check, 2)
