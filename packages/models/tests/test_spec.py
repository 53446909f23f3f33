"""The family registry: every size and config finds its ModelSpec, with no process."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mega_models import (
    GPTConfig,
    GPTModel,
    HybridConfig,
    HybridModel,
    hybrid_flops_per_token,
    model_config,
    model_flops_per_token,
)
from mega_models.spec import (
    LayoutRequest,
    all_specs,
    hf_spec,
    register_spec,
    resolve_model,
    spec_for,
)
from mega_models.stages import stage_layer_counts, stage_spec
from mega_parallel_grid import ParallelConfig
from mega_parallel_grid.testing import DistPool


def test_every_size_finds_its_family() -> None:
    specs = {s.name: s for s in all_specs()}
    assert set(specs) == {"gpt", "hybrid"}
    assert specs["gpt"].model_class is GPTModel and specs["hybrid"].model_class is HybridModel
    for spec in specs.values():
        for name, config in spec.sizes.items():
            assert spec_for(name) is spec
            assert spec_for(config) is spec
    with pytest.raises(
        ValueError, match=r"unknown model size 'huge'; known sizes: tiny, .*hybrid-tiny"
    ):
        spec_for("huge")


def test_a_config_subclass_without_its_own_spec_is_its_base_family() -> None:
    @dataclasses.dataclass(frozen=True)
    class Variant(GPTConfig):
        pass

    assert spec_for(Variant()).name == "gpt"
    assert spec_for(HybridConfig()).name == "hybrid"  # the most specific registered class


def test_register_refuses_a_taken_name_or_size() -> None:
    gpt = spec_for("tiny")
    with pytest.raises(ValueError, match="named 'gpt' is already registered"):
        register_spec(gpt)
    with pytest.raises(ValueError, match="registers sizes tiny that another family already has"):
        register_spec(dataclasses.replace(gpt, name="gpt2", sizes={"tiny": gpt.sizes["tiny"]}))


def test_flops_come_from_the_family() -> None:
    tiny, hybrid = model_config("tiny"), spec_for("hybrid-tiny").sizes["hybrid-tiny"]
    assert spec_for(tiny).flops_per_token(tiny, 128) == model_flops_per_token(tiny, 128)
    assert spec_for(hybrid).flops_per_token(hybrid, 128) == hybrid_flops_per_token(hybrid, 128)


def test_total_params_count_norms_per_layer_of_the_family() -> None:
    tiny = model_config("tiny")
    gpt = spec_for(tiny)
    h, v, n = tiny.hidden_size, tiny.vocab_size, tiny.num_layers
    # two pre-norms per layer and the final one; untied output layer
    assert gpt.total_params(tiny) == gpt.matmul_params(tiny) + v * h + (2 * n + 1) * h
    hybrid = spec_for("hybrid-tiny")
    c = hybrid.sizes["hybrid-tiny"]
    extra = hybrid.extra_params(c)
    assert extra > 0
    expected = hybrid.matmul_params(c) + c.vocab_size * c.hidden_size + (n + 1) * h + extra
    assert hybrid.total_params(c) == expected


def test_params_per_rank_split_dense_over_tp_and_experts_over_ep_etp() -> None:
    spec = spec_for("moe-tiny")
    c = spec.sizes["moe-tiny"]
    experts = spec.routed_expert_params(c)
    assert experts == 3 * 64 * 32 * 16 * 3  # swiglu, h 64, ffn 32, 16 experts, 3 MoE layers
    dense, expert = spec.params_per_rank(c, ParallelConfig(tp=2, ep=4, etp=1), c.num_layers)
    assert expert == experts // 4
    whole, _ = spec.params_per_rank(c, ParallelConfig(), c.num_layers)
    assert dense == whole // 2
    assert whole + experts == spec.total_params(c)


def _built_and_counted(sizes: list[str]) -> list[tuple[str, int, int]]:
    from mega_models import GPTModel
    from mega_parallel_grid.testing import solo_groups

    out = []
    for name in sizes:
        c = model_config(name)
        model = GPTModel(c, solo_groups(), seed=1, device="meta")
        out.append((name, sum(p.numel() for p in model.parameters()), spec_for(c).total_params(c)))
    return out


def test_total_params_equal_the_built_models_parameters(dist_pool: DistPool) -> None:
    """QK-norm's per-head-dim weights, MLA's latent norms, MTP depths and experts included."""
    sizes = ["tiny", "qwen3-tiny", "qwen3-moe-tiny", "moe-tiny", "deepseek-v3-tiny"]
    [rows] = dist_pool.run(_built_and_counted, 1, args=(sizes,))
    for name, built, counted in rows:
        assert built == counted, (
            f"{name}: the model has {built} parameters, the spec counts {counted}"
        )


def test_a_gpt_size_with_a_pattern_becomes_the_hybrid_of_its_dimensions() -> None:
    base = model_config("1b")
    pattern = "M-M-M*-" * 3 + "M"
    model = resolve_model("1b", {"pattern": pattern})
    assert isinstance(model, HybridConfig) and model.hidden_size == base.hidden_size
    assert model.num_layers == base.num_layers == len(pattern)
    assert resolve_model("tiny", {"num_layers": 4}) == model_config("tiny").replace(num_layers=4)
    with pytest.raises(
        ValueError, match=r"model.pattern 'M\*' has 2 layers but model.size 1b has 22"
    ):
        resolve_model("1b", {"pattern": "M*"})


def test_layout_checks_are_the_familys() -> None:
    hybrid = spec_for("hybrid-tiny")
    c = hybrid.sizes["hybrid-tiny"]
    hybrid.check_layout(c, LayoutRequest(ParallelConfig(tp=2), local_seq_len=64))
    with pytest.raises(ValueError, match=r"mamba_num_groups \(2\) is not divisible by tp \(4\)"):
        hybrid.check_layout(c, LayoutRequest(ParallelConfig(tp=4), local_seq_len=64))
    with pytest.raises(ValueError, match="GPT models only, not hybrid"):
        hybrid.check_layout(c, LayoutRequest(ParallelConfig(), local_seq_len=64, fp8=True))
    with pytest.raises(ValueError, match=r"cp \(2\) > 1 is not supported for hybrid"):
        hybrid.check_layout(c, LayoutRequest(ParallelConfig(cp=2), local_seq_len=64))
    gpt = spec_for("tiny")
    gpt.check_layout(
        model_config("tiny"), LayoutRequest(ParallelConfig(cp=2), local_seq_len=64, fp8=True)
    )
    with pytest.raises(ValueError, match=r"ep \(2\) > 1 needs an MoE model"):
        gpt.check_layout(
            model_config("tiny"), LayoutRequest(ParallelConfig(ep=2), local_seq_len=64)
        )


def test_one_stage_split_with_one_error_text() -> None:
    assert stage_layer_counts(8, pp=2, vpp=2) == (2, 2, 2, 2)
    assert stage_layer_counts(8, pp=2, split=[5, 3]) == (5, 3)
    assert stage_spec(8, pp=2, pp_rank=1, split=[5, 3]).layers == (5, 6, 7)
    with pytest.raises(
        ValueError, match=r"num_layers \(6\) is not divisible into pp\*vpp \(4\*1 = 4\)"
    ):
        stage_layer_counts(6, pp=4)
    with pytest.raises(ValueError, match=r"parallel.pp_layers \[8, 0\] must give 2 positive layer"):
        stage_layer_counts(8, pp=2, split=[8, 0], split_name="parallel.pp_layers")


def test_the_hf_adapter_belongs_to_gpt(tmp_path: Path) -> None:
    assert hf_spec(tmp_path / "missing").name == "gpt"  # its reader says what is missing
    hybrid = spec_for("hybrid-tiny").hf  # Nemotron-H (mega_models.hf.nemotron_h)
    assert hybrid is not None and hybrid.architectures == ("NemotronHForCausalLM",)
    hf = spec_for("tiny").hf
    assert hf is not None and "LlamaForCausalLM" in hf.architectures
