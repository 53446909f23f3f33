"""HF bridge: a config.json that leaves a key out reads as ``transformers`` reads it (its
own per-architecture default), and one without a shape key fails in one sentence."""

from __future__ import annotations

from typing import Any

import pytest
from _hf_common import one_sentence

from mega_models.hf import gpt_config_from_hf, hf_config_from_gpt, hf_layout
from mega_models.hf.nemotron_h_config import nemotron_h_config_from_hf

SHAPES = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip


def _without(cfg: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if k not in keys}


def test_mixtral_defaults_are_transformers() -> None:
    """MixtralConfig's defaults: rms_norm_eps 1e-5, rope_theta 1e6 (not Llama's)."""
    cfg = {**SHAPES, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4}
    config = gpt_config_from_hf(cfg)
    assert config.norm_eps == 1e-5
    assert config.rope_theta == 1e6


def test_qwen3_head_dim_default_is_128() -> None:
    """Qwen3Config's head_dim defaults to 128, whatever hidden_size / heads is."""
    cfg = {**SHAPES, "architectures": ["Qwen3ForCausalLM"]}
    assert gpt_config_from_hf(cfg).head_dim == 128


def test_qwen2_moe_shared_expert_default() -> None:
    cfg = {**SHAPES, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4,
           "num_experts_per_tok": 2}  # fmt: skip
    assert gpt_config_from_hf(cfg).moe_shared_expert_size == 5632


def test_deepseek_v3_defaults_are_transformers() -> None:
    """DeepseekV3Config's routing, ranks and MTP defaults (routed_scaling_factor 2.5, 8
    groups of which 4 are picked, 3 dense layers, q_lora_rank 1536, one MTP depth)."""
    cfg = {
        **SHAPES, "num_key_value_heads": 4, "architectures": ["DeepseekV3ForCausalLM"],
        "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 16,
        "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
    }  # fmt: skip
    config = gpt_config_from_hf(cfg)
    assert config.moe_scaling_factor == 2.5
    assert (config.moe_num_groups, config.moe_group_topk) == (8, 4)
    assert list(config.moe_layers) == [3]
    assert config.q_lora_rank == 1536 and hf_layout(cfg).q_lora
    assert config.mtp_num_layers == 1
    assert config.moe_shared_expert_size == 16
    # an explicit null still means no low-rank query
    assert gpt_config_from_hf({**cfg, "q_lora_rank": None}).q_lora_rank is None


def test_nemotron_h_kv_heads_default_is_8() -> None:
    cfg = {
        "architectures": ["NemotronHForCausalLM"], "vocab_size": 64, "hidden_size": 64,
        "num_attention_heads": 16, "head_dim": 4, "intermediate_size": 64,
        "layers_block_type": ["linear_attention", "full_attention", "mlp"],
        "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 8,
    }  # fmt: skip
    assert nemotron_h_config_from_hf(cfg).kv_heads == 8


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "DeepseekV3ForCausalLM"])
def test_missing_shape_key_fails_in_one_sentence(arch: str) -> None:
    cfg = {**_without(SHAPES, "num_hidden_layers"), "architectures": [arch]}
    with pytest.raises(ValueError) as err:
        gpt_config_from_hf(cfg)
    one_sentence(err, "num_hidden_layers", arch)
    with pytest.raises(ValueError) as err:
        hf_layout(cfg)
    one_sentence(err, "num_hidden_layers", arch)


YARN_40 = {
    "type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
}  # fmt: skip
DEEPSEEK_4X = {
    **SHAPES, "num_key_value_heads": 4, "architectures": ["DeepseekV3ForCausalLM"],
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "moe_intermediate_size": 16, "q_lora_rank": None,
    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
    "n_shared_experts": 1, "num_nextn_predict_layers": 0, "routed_scaling_factor": 1.0,
    "rope_theta": 10000.0, "rope_scaling": YARN_40,
}  # fmt: skip


def test_deepseek_v3_rope_scaling_wins_as_in_transformers() -> None:
    """transformers 5 takes ``rope_scaling`` over ``rope_parameters`` when both are given."""
    both = {**DEEPSEEK_4X, "rope_parameters": {**YARN_40, "type": "yarn", "factor": 8.0}}
    assert gpt_config_from_hf(both).rope_scaling_factor == 40.0


def test_deepseek_v3_yarn_export_is_read_by_both_layouts() -> None:
    """A YaRN model is written with rope_scaling (transformers 4.x) as well, and a base
    config's stale rope_scaling never outlives a change of the model's YaRN."""
    config = gpt_config_from_hf(DEEPSEEK_4X)
    fresh = hf_config_from_gpt(config)
    assert fresh["rope_scaling"]["rope_type"] == "yarn"
    assert fresh["rope_scaling"]["factor"] == 40.0
    assert gpt_config_from_hf(fresh) == config
    kept = hf_config_from_gpt(config, base=DEEPSEEK_4X)
    assert kept["rope_scaling"] == YARN_40  # unchanged model: the base's spelling
    longer = config.replace(rope_scaling_factor=8.0)
    out = hf_config_from_gpt(longer, base=DEEPSEEK_4X)
    assert out["rope_scaling"]["factor"] == 8.0
    assert gpt_config_from_hf(out) == longer
    plain = {**DEEPSEEK_4X, "rope_scaling": None}
    out = hf_config_from_gpt(gpt_config_from_hf(plain), base=DEEPSEEK_4X)
    assert not out.get("rope_scaling")
    assert gpt_config_from_hf(out) == gpt_config_from_hf(plain)
    assert gpt_config_from_hf(out).rope_scaling_factor is None
