"""HF bridge for mixtures of experts: a tiny random Mixtral and Qwen2-MoE built with
``transformers`` (no download), imported at tp x pp x ep, give transformers' logits;
exported back, the same tensors and config.json. Qwen2's q/k/v-only biases
(``GPTConfig.qkv_bias``) survive training and export as Qwen2.

``transformers`` is imported only in the pytest process (inside fixtures and tests): the
rank workers import this module too, and need only torch, mega and safetensors.
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _hf_common import forward_stages, one_sentence, randomise, read_all, saved_checkpoints

from mega_models import GPTConfig, GPTModel, stage_spec
from mega_models.hf import (
    default_architecture,
    gather_full_state,
    gpt_config_from_hf,
    gpt_parameter_names,
    hf_config_from_gpt,
    hf_layout,
    hf_state_dict,
    hf_tensor_names,
    load_hf_weights,
    routing_semantics,
    save_hf_checkpoint,
    stack_grid,
    unstack_grid,
)
from mega_models.hf.moe import qwen2_moe_pattern, qwen2_moe_sparse_step
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device, solo_groups
from mega_tp_layers import shard_spec

# fp32 on both sides, same formulas. The differences are only the order of float sums:
# tp/etp split the attention-output and expert-down GEMM reductions and add the partial
# sums, a token's top-k expert outputs are added in another order, grouped GEMMs and
# SDPA block differently. The router sees inputs equal up to that rounding and computes
# its fp32 softmax and top-k with the same ops, so it picks the same experts (a different
# pick moves a logit by O(1)). Logits are compared with rtol 1e-5 and an absolute
# tolerance of 1e-5 of the largest logit (~80 fp32 ulps at that magnitude; measured
# errors are below 1e-6 on logits of ~1.5).
RTOL = 1e-5
BATCH, SEQ = 2, 12
SHARD_BYTES = 40_000  # several shards per checkpoint, experts spread over them
# keys the exporter adds for transformers 4.x readers (5.x folds them into its own)
COMPAT_KEYS = {"rope_theta", "torch_dtype"}

SHAPES: dict[str, Any] = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "vocab_size": 101,  # odd: padded to a multiple of tp
    "max_position_embeddings": 64,
}
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_hidden_layers": 4, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40,
                   "decoder_sparse_step": 1, "mlp_only_layers": [2],
                   "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_hidden_layers": 2}),
}  # fmt: skip
ROPE_THETA = 50_000.0


def _hf_model(arch: str) -> Any:
    """A seeded random transformers model; norm scales, biases and routers randomised too."""
    import transformers

    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(**SHAPES, **extra)
    config.rope_parameters["rope_theta"] = ROPE_THETA
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    return randomise(model)


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=ids).logits.float()
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any, Any]]:
    """Per architecture: the saved directory, token ids [b, s] and transformers' logits."""
    models = {arch: partial(_hf_model, arch) for arch in ARCHS}
    return saved_checkpoints(models, tmp_path_factory, SHARD_BYTES, BATCH, SEQ)


def _close(mine: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(mine, ref, rtol=RTOL, atol=RTOL * float(ref.abs().max()))


# import at tp x pp x ep, export back ----------------------------------------------------


def _import_export(
    hf_dir: str, out_dir: str, layout: tuple[int, int, int], grouped: bool,
    ids: torch.Tensor, ref: torch.Tensor,
) -> None:  # fmt: skip
    tp, pp, ep = layout
    groups = init_process_groups(ParallelConfig(tp=tp, pp=pp, ep=ep))
    config = gpt_config_from_hf(hf_dir).replace(moe_grouped_experts=grouped)
    stage = stage_spec(config.num_layers, pp, groups.rank("pp"))
    model = GPTModel(config, groups, stage=stage, seed=5, device=rank_device()).eval()
    load_hf_weights(model, hf_dir)
    logits = forward_stages(model, groups, ids)  # every dp (and ep) rank runs the same ids
    if logits is not None:
        _close(logits, ref)
    if ep > 1 or tp > 1:  # an expert or tp shard alone cannot be exported
        dim, size = ("tp", tp) if tp > 1 else ("ep", ep)
        with pytest.raises(ValueError, match=rf"split over {dim} \({size}\)") as err:
            save_hf_checkpoint(model, out_dir)
        assert "\n" not in str(err.value)
    state = gather_full_state(model, groups.pp)  # collective over tp, etp, ep and pp
    assert (state is None) == (groups.rank("pp") != 0)
    if dist.get_rank() != 0:
        return
    assert state is not None
    assert sorted(state) == sorted(gpt_parameter_names(config))
    if tp == pp == ep == 1:  # from the model itself
        save_hf_checkpoint(model, out_dir, base_config=hf_dir, max_shard_size=SHARD_BYTES)
    else:
        save_hf_checkpoint(state, out_dir, config=config, base_config=hf_dir,
                           max_shard_size=SHARD_BYTES)  # fmt: skip


LAYOUTS = [
    (arch, layout, True)
    for arch in ("mixtral", "qwen2_moe")
    for layout in ((1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2))
] + [
    ("mixtral", (2, 1, 2), True),  # etp 2 x ep 2 on 4 ranks
    ("qwen2_moe", (1, 1, 2), False),  # SequentialMLP experts, one module per expert
]


@pytest.mark.parametrize(("arch", "layout", "grouped"), LAYOUTS, ids=str)
def test_import_matches_transformers_and_export_is_identical(
    dist_pool: DistPool,
    checkpoints: dict[str, tuple[Path, Any, Any]],
    tmp_path: Path,
    arch: str,
    layout: tuple[int, int, int],
    grouped: bool,
) -> None:
    hf_dir, ids, ref = checkpoints[arch]
    out = tmp_path / "export"
    world = layout[0] * layout[1] * layout[2]
    dist_pool.run(_import_export, world, args=(str(hf_dir), str(out), layout, grouped, ids, ref))
    assert (out / "model.safetensors.index.json").is_file()
    original, exported = read_all(hf_dir), read_all(out)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name
    written = json.loads((out / "config.json").read_text())
    source = json.loads((hf_dir / "config.json").read_text())
    assert {k: written.get(k) for k in source} == source
    assert set(written) - set(source) <= COMPAT_KEYS
    assert gpt_config_from_hf(out) == gpt_config_from_hf(hf_dir)
    _check_from_pretrained(out, ids, ref, ARCHS[arch][1])


def _check_from_pretrained(out: Path, ids: torch.Tensor, ref: torch.Tensor, cls: str) -> None:
    """transformers itself reads the export: the same weights, the same code, the same bits."""
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == cls
    assert torch.equal(_logits(model.eval(), ids), ref)


# config mapping ---------------------------------------------------------------------------


def test_config_from_hf_fields(checkpoints: dict[str, tuple[Path, Any, Any]]) -> None:
    mixtral = gpt_config_from_hf(checkpoints["mixtral"][0])
    assert (mixtral.num_experts, mixtral.moe_top_k, mixtral.moe_ffn_size) == (4, 2, 48)
    assert mixtral.moe_layers == (0, 1) and mixtral.moe_shared_expert_size == 0
    assert mixtral.moe_softmax_before_topk and mixtral.moe_normalize_topk
    assert routing_semantics(mixtral) == "softmax, top-k renormalised"
    assert not mixtral.qkv_bias and not mixtral.add_bias and mixtral.rope_theta == ROPE_THETA
    qwen = gpt_config_from_hf(checkpoints["qwen2_moe"][0])
    assert (qwen.num_experts, qwen.moe_top_k, qwen.moe_ffn_size, qwen.ffn_size) == (4, 2, 24, 48)
    assert qwen.moe_layer_pattern == "EE-E" and qwen.moe_layers == (0, 1, 3)
    assert (qwen.moe_shared_expert_size, qwen.moe_shared_expert_gate) == (40, True)
    assert routing_semantics(qwen) == "softmax, top-k probabilities"  # norm_topk_prob false
    assert qwen.qkv_bias and not qwen.add_bias and qwen.tie_embeddings
    assert default_architecture(mixtral) == "MixtralForCausalLM"
    assert default_architecture(qwen) == "Qwen2MoeForCausalLM"
    for config in (mixtral, qwen):  # written without a base, it reads the same
        assert gpt_config_from_hf(hf_config_from_gpt(config)) == config
    normed = {**json.loads((checkpoints["qwen2_moe"][0] / "config.json").read_text()),
              "norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": [3]}  # fmt: skip
    config = gpt_config_from_hf(normed)
    assert routing_semantics(config) == "softmax, top-k renormalised"
    assert config.moe_layer_pattern == "-E--"
    back = hf_config_from_gpt(config)
    assert (back["decoder_sparse_step"], back["mlp_only_layers"]) == (2, [3])
    assert back["norm_topk_prob"]
    # a Qwen2-MoE of transformers 4.x: no qkv_bias key, q/k/v biases always
    legacy = {k: v for k, v in normed.items() if k != "qkv_bias"}
    assert hf_layout(legacy).qkv_bias and gpt_config_from_hf(legacy).qkv_bias


def test_sparse_layer_placement() -> None:
    assert qwen2_moe_pattern(4, 1, []) == "EEEE"
    assert qwen2_moe_pattern(4, 2, []) == "-E-E"
    assert qwen2_moe_pattern(6, 3, [5]) == "--E---"
    config = GPTConfig(hidden_size=32, num_layers=6, num_attention_heads=4, num_experts=4,
                       moe_layer_pattern="-E-E--")  # fmt: skip
    assert qwen2_moe_sparse_step(config) == (2, [5])
    assert qwen2_moe_sparse_step(config, preferred=1) == (1, [0, 2, 4, 5])
    assert qwen2_moe_sparse_step(config, preferred=4) == (2, [5])  # 4 misses layer 1
    freq = config.replace(moe_layer_pattern=None, moe_layer_freq=2)  # mega: layers 0, 2, 4
    step, mlp_only = qwen2_moe_sparse_step(freq)
    assert qwen2_moe_pattern(6, step, mlp_only) == "E-E-E-"


def test_stack_helpers_invert() -> None:
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(3, 5, generator=gen) for _ in range(8)]
    full = stack_grid(parts, (4, 2))  # 4 experts x (gate, up)
    assert full.shape == (4, 2, 3, 5) and torch.equal(full[2, 1], parts[5])
    assert all(torch.equal(a, b) for a, b in zip(unstack_grid(full, (4, 2)), parts, strict=True))


def test_tensor_names_of_both_architectures(checkpoints: dict[str, tuple[Path, Any, Any]]) -> None:
    for arch in ("mixtral", "qwen2_moe"):
        path = checkpoints[arch][0]
        names = hf_tensor_names(gpt_config_from_hf(path), hf_layout(path))
        assert sorted(names) == sorted(read_all(path))
        assert len(set(names)) == len(names)


# q/k/v-only biases --------------------------------------------------------------------------


def test_qkv_bias_config() -> None:
    config = GPTConfig(hidden_size=32, num_layers=2, num_attention_heads=4, qkv_bias=True)
    names = gpt_parameter_names(config)
    assert "layers.0.attention.qkv.bias" in names
    assert not any(n.endswith(("proj.bias", "fc1.bias", "fc2.bias")) for n in names)
    moe = config.replace(num_experts=4)  # experts have no biases, q/k/v may
    assert "layers.1.attention.qkv.bias" in gpt_parameter_names(moe)
    with pytest.raises(ValueError) as err:
        config.replace(add_bias=True)
    one_sentence(err, "qkv_bias (True)", "add_bias (True)", "set one of them to false")


def _trained_qwen2(hf_dir: str, out_dir: str, ids: torch.Tensor) -> torch.Tensor | None:
    """Import Qwen2 at tp 2, move every weight (as training would), export as Qwen2."""
    groups = init_process_groups(ParallelConfig(tp=2))
    config = gpt_config_from_hf(hf_dir)
    model = GPTModel(config, groups, seed=5, device=rank_device()).eval()
    load_hf_weights(model, hf_dir)
    names = {n for n, _ in model.named_parameters()}
    assert "layers.0.attention.qkv.bias" in names
    assert not any(n.endswith(("proj.bias", "fc1.bias", "fc2.bias")) for n in names)
    with torch.no_grad():  # shards move apart, tp replicas (norms) alike
        for i, p in enumerate(model.parameters()):
            spec = shard_spec(p)
            split = spec is not None and spec.dim is not None
            gen = torch.Generator().manual_seed(100 * i + (groups.rank("tp") if split else 0))
            p.add_(0.02 * torch.randn(p.shape, generator=gen).to(p.device))
    logits = forward_stages(model, groups, ids)
    state = gather_full_state(model)
    if dist.get_rank() != 0:
        return None
    assert state is not None and state["layers.1.attention.qkv.bias"].abs().min() > 0
    save_hf_checkpoint(state, out_dir, config=config, base_config=hf_dir)
    return logits


def test_trained_qwen2_exports_as_qwen2(
    dist_pool: DistPool, checkpoints: dict[str, tuple[Path, Any, Any]], tmp_path: Path
) -> None:
    import transformers

    hf_dir, ids, _ = checkpoints["qwen2"]
    out = tmp_path / "trained"
    mine, _ = dist_pool.run(_trained_qwen2, 2, args=(str(hf_dir), str(out), ids))
    assert sorted(read_all(out)) == sorted(read_all(hf_dir))  # q/k/v biases, no others
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    _close(mine, _logits(model.eval(), ids))


# bad input ----------------------------------------------------------------------------------


def test_bad_configs_fail_inone_sentence(checkpoints: dict[str, tuple[Path, Any, Any]]) -> None:
    mixtral = json.loads((checkpoints["mixtral"][0] / "config.json").read_text())
    qwen = json.loads((checkpoints["qwen2_moe"][0] / "config.json").read_text())
    bad: list[tuple[dict[str, Any], tuple[str, ...]]] = [
        ({**mixtral, "architectures": ["Glm4MoeForCausalLM"]},
         ("Glm4MoeForCausalLM", "not supported", "Qwen2MoeForCausalLM")),
        ({**mixtral, "router_jitter_noise": 0.1}, ("router_jitter_noise (0.1)", "set it to 0.0")),
        ({**qwen, "shared_expert_intermediate_size": 0}, ("shared_expert_intermediate_size (0)",)),
        ({**qwen, "decoder_sparse_step": 0}, ("decoder_sparse_step (0)",)),
        ({**qwen, "mlp_only_layers": [0, 1, 2, 3]}, ("mlp_only_layers ([0, 1, 2, 3])", "no sparse")),
        ({**qwen, "num_experts_per_tok": 5}, ("moe_top_k (5)",)),
    ]  # fmt: skip
    for cfg, words in bad:
        with pytest.raises(ValueError) as err:
            gpt_config_from_hf(cfg)
        one_sentence(err, *words)


def test_unexpressible_models_fail_to_export_inone_sentence() -> None:
    base = GPTConfig(hidden_size=32, num_layers=2, num_attention_heads=4, num_experts=4)
    qwen = base.replace(moe_shared_expert_size=16, moe_shared_expert_gate=True)
    bad: list[tuple[GPTConfig, str, tuple[str, ...]]] = [
        (base, "LlamaForCausalLM", ("LlamaForCausalLM is dense", "4 experts")),
        (base.replace(num_experts=0), "MixtralForCausalLM", ("model is dense",)),
        (base.replace(moe_layer_pattern="-E"), "MixtralForCausalLM", ("layers [0]", "dense")),
        (qwen, "MixtralForCausalLM", ("no shared expert", "Qwen2MoeForCausalLM")),
        (base.replace(moe_softmax_before_topk=True), "MixtralForCausalLM",
         ("softmax, top-k probabilities", "norm_topk_prob")),
        (base, "Qwen2MoeForCausalLM", ("sigmoid-gated shared expert",)),
        (qwen.replace(moe_score_function="sigmoid"), "Qwen2MoeForCausalLM",
         ("moe_score_function ('sigmoid')",)),
        (qwen.replace(moe_expert_bias=True), "Qwen2MoeForCausalLM", ("moe_expert_bias (True)",)),
        (qwen.replace(moe_scaling_factor=2.5), "Qwen2MoeForCausalLM", ("moe_scaling_factor",)),
    ]  # fmt: skip
    for config, arch, words in bad:
        with pytest.raises(ValueError) as err:
            hf_config_from_gpt(config, arch)
        one_sentence(err, *words)


def _broken(src: Path, dst: Path, tensor: str) -> Path:
    """A copy of ``src`` whose index no longer lists ``tensor``."""
    shutil.copytree(src, dst)
    index_file = dst / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    del index["weight_map"][tensor]
    index_file.write_text(json.dumps(index))
    return dst


def _missing_expert(broken: str) -> str | None:
    """Import at ep 2: only the rank that holds the missing expert reads it, and fails."""
    groups = init_process_groups(ParallelConfig(ep=2))
    model = GPTModel(gpt_config_from_hf(broken), groups, device=rank_device())
    try:
        load_hf_weights(model, broken)
    except ValueError as exc:
        return str(exc)
    return None


MISSING = "model.layers.1.block_sparse_moe.experts.3.w3.weight"


def test_missing_expert_tensor_names_it(
    dist_pool: DistPool, checkpoints: dict[str, tuple[Path, Any, Any]], tmp_path: Path
) -> None:
    broken = _broken(checkpoints["mixtral"][0], tmp_path / "broken", MISSING)
    first, second = dist_pool.run(_missing_expert, 2, args=(str(broken),))
    assert first is None  # experts 0 and 1: the missing one is never read
    assert second is not None and "\n" not in second
    assert MISSING in second and "is not in the checkpoint" in second


def _load_variants(mixtral: str, qwen2: str, ids: torch.Tensor, ref: torch.Tensor) -> list[str]:
    """Models that differ from the checkpoint: equivalent ones load, the others fail."""
    groups, dev = solo_groups(), rank_device()
    config = gpt_config_from_hf(mixtral)
    # top-k of the logits, then softmax: Mixtral's weights by another formula
    other = config.replace(moe_softmax_before_topk=False, moe_normalize_topk=False)
    model = GPTModel(other, groups, device=dev).eval()
    load_hf_weights(model, mixtral)
    with torch.no_grad():
        _close(model(ids.to(dev))[..., : config.vocab_size].cpu(), ref)
    # aux-loss-free routing biases start from zero, whatever they held
    biased = GPTModel(config.replace(moe_expert_bias=True), groups, device=dev)
    for router in (layer.mlp.router for layer in biased.layers.values()):
        assert router.expert_bias is not None
        router.expert_bias.fill_(0.5)
    load_hf_weights(biased, mixtral)
    assert all(layer.mlp.router.expert_bias.abs().sum() == 0 for layer in biased.layers.values())
    # more biases than the checkpoint: zeros (the pre-qkv_bias way Qwen2 was imported)
    qwen = gpt_config_from_hf(qwen2)
    load_hf_weights(GPTModel(qwen.replace(qkv_bias=False, add_bias=True), groups), qwen2)
    messages = []
    for mismatched, path in (
        (config.replace(moe_top_k=1), mixtral),
        (config.replace(moe_normalize_topk=False), mixtral),
        (config.replace(moe_layer_pattern="E-"), mixtral),
        (qwen.replace(qkv_bias=False), qwen2),
    ):
        try:
            load_hf_weights(GPTModel(mismatched, groups), path)
        except ValueError as exc:
            messages.append(str(exc))
    # a trained q/k/v bias cannot go to Mixtral, which has none
    state = gather_full_state(GPTModel(config.replace(qkv_bias=True), groups))
    assert state is not None
    state["layers.0.attention.qkv.bias"][0] = 1.0
    try:
        hf_state_dict(state, config.replace(qkv_bias=True), hf_layout(mixtral))
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def test_load_checks_the_function_not_the_training_settings(
    dist_pool: DistPool, checkpoints: dict[str, tuple[Path, Any, Any]]
) -> None:
    (mixtral, ids, ref), qwen2 = checkpoints["mixtral"], checkpoints["qwen2"][0]
    [messages] = dist_pool.run(_load_variants, 1, args=(str(mixtral), str(qwen2), ids, ref))
    expected = [
        ("moe_top_k (1)", "(2)", "gpt_config_from_hf"),
        ("routing ('softmax, top-k probabilities')", "('softmax, top-k renormalised')"),
        ("moe_layers ((0,))", "((0, 1))"),
        ("qkv_bias (False)", "(True)"),
        ("layers.0.attention.qkv.bias", "not zero", "MixtralForCausalLM", "Qwen2MoeForCausalLM"),
    ]
    assert len(messages) == len(expected), messages
    for message, words in zip(messages, expected, strict=True):
        assert "\n" not in message, message
        for word in words:
            assert word in message, (word, message)
