"""DeepSeek-V3 ``config.json`` keys <-> GPTConfig fields: latent attention, routing, MTP.

Pure dictionaries, no torch. ``DeepseekV3ForCausalLM`` is a Llama-family decoder (RMSNorm,
SwiGLU, RoPE) with:

* multi-head latent attention (``GPTConfig.attention = "mla"``): ``q_lora_rank`` (None: a
  plain ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
  ``v_head_dim``; ``rope_interleave`` says the checkpoint's rope rows are interleaved
  pairs (the bridge permutes them, :mod:`mega_models.hf.mapping`); YaRN rope scaling;
* its routing, as ``transformers`` computes it (``DeepseekV3TopkRouter``): sigmoid scores,
  the ``e_score_correction_bias`` added for the choice only (mega's expert bias, loaded
  from and written to the checkpoint), ``n_group`` / ``topk_group`` group-limited routing
  where a group scores the sum of its best 2 biased scores (``moe_group_score_topk=2``),
  ``norm_topk_prob``, ``routed_scaling_factor``;
* ``first_k_dense_replace`` leading dense layers of ``intermediate_size`` (mega's
  ``moe_layer_pattern``), the rest MoE layers of ``n_routed_experts`` experts of
  ``moe_intermediate_size`` plus one ungated shared expert of ``n_shared_experts *
  moe_intermediate_size``;
* ``num_nextn_predict_layers`` multi-token prediction depths (``mtp_num_layers``), stored
  after the decoder as ``model.layers.{num_hidden_layers + k}`` (transformers' model
  ignores them; mega reads and writes them).

``moe_layer_freq`` (of DeepSeek's own code; transformers ignores it) must be 1, and
``scoring_func`` / ``topk_method``, where given, DeepSeek-V3's ``sigmoid`` / ``noaux_tc``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mega_models.config import GPTConfig

__all__ = [
    "DEEPSEEK_V3",
    "check_deepseek_export",
    "deepseek_fields_from_hf",
    "deepseek_pattern",
    "hf_deepseek_keys",
]

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
#: DeepSeek-V3 (and transformers) score a group by the sum of its best this-many scores.
GROUP_SCORE_TOPK = 2
_YARN_KEYS = {
    "factor": "rope_scaling_factor",
    "original_max_position_embeddings": "rope_original_max_position",
    "beta_fast": "rope_beta_fast",
    "beta_slow": "rope_beta_slow",
    "mscale": "rope_mscale",
    "mscale_all_dim": "rope_mscale_all_dim",
}


def deepseek_pattern(num_layers: int, first_dense: int) -> str:
    """``moe_layer_pattern`` of ``first_dense`` dense layers, then MoE layers."""
    if not isinstance(first_dense, int) or not 0 <= first_dense < num_layers:
        raise ValueError(
            f"first_k_dense_replace ({first_dense!r}) of {DEEPSEEK_V3} must leave at least one "
            f"MoE layer among its {num_layers} layers; choose 0 to {num_layers - 1}"
        )
    return "-" * first_dense + "E" * (num_layers - first_dense)


def _refuse(key: str, value: object, why: str) -> ValueError:
    return ValueError(f"{key} ({value!r}) of {DEEPSEEK_V3} is not supported; {why}")


def _check_flags(cfg: Mapping[str, Any]) -> None:
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    for key, value, ok, why in (
        ("attention_bias", cfg.get("attention_bias", False), False,
         "mega's latent attention has no biases (set it to false)"),
        ("moe_layer_freq", cfg.get("moe_layer_freq", 1), 1,
         "every layer after first_k_dense_replace is an MoE layer (set it to 1)"),
        ("scoring_func", cfg.get("scoring_func", "sigmoid"), "sigmoid",
         "DeepSeek-V3 routes with sigmoid scores"),
        ("topk_method", cfg.get("topk_method", "noaux_tc"), "noaux_tc",
         "DeepSeek-V3 routes with noaux_tc (the bias-corrected group-limited top-k)"),
        ("num_key_value_heads", kv, heads if kv is not None else None,
         "latent attention gives every head its own key (use num_attention_heads)"),
    ):  # fmt: skip
        if value != ok:
            raise _refuse(key, value, why)
    shared = int(cfg.get("n_shared_experts") or 0)
    if shared < 1:
        raise _refuse("n_shared_experts", shared, "mega builds DeepSeek-V3 with a shared expert")


def _rope_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """GPTConfig's YaRN fields (none for plain rope)."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})  # as transformers 5
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {}
    if kind != "yarn":
        raise _refuse("rope_type", kind, "only DeepSeek's YaRN scaling (rope_type 'yarn') converts")
    unknown = sorted(set(params) - {*_YARN_KEYS, "rope_type", "type", "rope_theta"})
    if unknown:
        raise _refuse(
            "rope_parameters", unknown, "mega's YaRN takes factor, original_max_position_"
            "embeddings, beta_fast, beta_slow, mscale and mscale_all_dim"
        )  # fmt: skip
    out: dict[str, Any] = {
        field: float(params[key])
        for key, field in _YARN_KEYS.items()
        if params.get(key) is not None
    }
    if "rope_original_max_position" in out:
        out["rope_original_max_position"] = int(out["rope_original_max_position"])
    return out


def deepseek_fields_from_hf(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """GPTConfig keyword arguments for a DeepSeek-V3 config's attention, experts and MTP."""
    _check_flags(cfg)
    num_layers = int(cfg["num_hidden_layers"])
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    pattern = deepseek_pattern(num_layers, first_dense)
    groups, picked = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    grouped = groups > 1
    moe_ffn = int(cfg.get("moe_intermediate_size", 2048))
    q_lora = cfg.get("q_lora_rank")
    return {
        "attention": "mla",
        "q_lora_rank": None if q_lora is None else int(q_lora),
        "kv_lora_rank": int(cfg["kv_lora_rank"]),
        "qk_nope_head_dim": int(cfg["qk_nope_head_dim"]),
        "qk_rope_head_dim": int(cfg["qk_rope_head_dim"]),
        "v_head_dim": int(cfg["v_head_dim"]),
        **_rope_fields(cfg),
        "num_experts": int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 256))),
        "moe_top_k": int(cfg.get("num_experts_per_tok", 8)),
        "moe_ffn_hidden_size": moe_ffn,
        "moe_layer_pattern": None if first_dense == 0 else pattern,
        "moe_shared_expert_size": int(cfg["n_shared_experts"]) * moe_ffn,
        "moe_score_function": "sigmoid",
        "moe_normalize_topk": bool(cfg.get("norm_topk_prob", True)),
        "moe_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
        "moe_num_groups": groups if grouped else None,
        "moe_group_topk": picked if grouped else None,
        "moe_group_score_topk": GROUP_SCORE_TOPK if grouped else None,
        "moe_expert_bias": True,
        "mtp_num_layers": int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0))),
    }


def _group_score_topk(config: GPTConfig) -> int | None:
    if config.moe_num_groups is None:
        return None
    return config.moe_config().router.group_scored_by


def check_deepseek_export(config: GPTConfig) -> None:
    """Raise, in one sentence, if ``config`` cannot be written as DeepSeek-V3."""
    if config.attention != "mla":
        raise ValueError(
            f"{DEEPSEEK_V3} has latent attention but the model has attention "
            f"{config.attention!r}; set attention='mla' with its ranks, or export it as a "
            "Llama-family architecture"
        )
    if not config.is_moe:
        raise ValueError(
            f"{DEEPSEEK_V3} is a mixture of experts but the model is dense (num_experts 0); "
            "add experts, or export it as another architecture"
        )
    c = config
    dense = [i for i in range(c.num_layers) if not c.is_moe_layer(i)]
    first = len(dense)
    checks: tuple[tuple[str, object, bool, str], ...] = (
        ("moe_layer_pattern", c.moe_layer_pattern, dense == list(range(first)),
         "DeepSeek-V3's dense layers are its first ones (first_k_dense_replace)"),
        ("moe_score_function", c.moe_score_function, c.moe_score_function == "sigmoid",
         "DeepSeek-V3 routes with sigmoid scores"),
        ("moe_shared_expert_size", c.moe_shared_expert_size,
         c.moe_shared_expert_size > 0 and c.moe_shared_expert_size % c.moe_ffn_size == 0,
         f"its shared expert is n_shared_experts x moe_ffn_size ({c.moe_ffn_size}), at least one"),
        ("moe_shared_expert_gate", c.moe_shared_expert_gate, not c.moe_shared_expert_gate,
         "DeepSeek-V3's shared expert has no gate"),
        ("moe_group_score_topk", _group_score_topk(c),
         _group_score_topk(c) in (None, GROUP_SCORE_TOPK),
         f"DeepSeek-V3 scores a group by its best {GROUP_SCORE_TOPK} (set it to 2)"),
    )  # fmt: skip
    for field, value, ok, why in checks:
        if not ok:
            raise ValueError(
                f"GPTConfig.{field} ({value!r}) cannot be written as {DEEPSEEK_V3}: {why}"
            )


def hf_deepseek_keys(config: GPTConfig, base: Mapping[str, Any]) -> dict[str, Any]:
    """The config.json keys of ``config``'s attention, experts and MTP as DeepSeek-V3.

    ``base`` is the config being written: its ``rope_interleave`` (how the rope rows are
    stored; default true, as DeepSeek ships them) is kept, and the tensors written so.
    YaRN is written as ``rope_parameters`` (transformers 5) and ``rope_scaling`` (4.x)."""
    c = config
    assert c.kv_lora_rank and c.qk_nope_head_dim and c.qk_rope_head_dim and c.v_head_dim
    out: dict[str, Any] = {
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "qk_head_dim": c.qk_nope_head_dim + c.qk_rope_head_dim,
        "head_dim": c.qk_rope_head_dim,  # transformers' rope width
        "num_key_value_heads": c.num_attention_heads,
        "rope_interleave": bool(base.get("rope_interleave", True)),
        "attention_bias": False,
        "n_routed_experts": c.num_experts,
        "num_experts_per_tok": c.moe_top_k,
        "moe_intermediate_size": c.moe_ffn_size,
        "n_shared_experts": c.moe_shared_expert_size // c.moe_ffn_size,
        "first_k_dense_replace": c.num_layers - len(c.moe_layers),
        "norm_topk_prob": c.moe_normalize_topk,
        "routed_scaling_factor": c.moe_scaling_factor,
        "n_group": c.moe_num_groups or 1,
        "topk_group": c.moe_group_topk or 1,
        "num_nextn_predict_layers": c.mtp_num_layers,
    }
    if c.rope_scaling_factor is not None:
        params: dict[str, Any] = {"rope_type": "yarn", "rope_theta": c.rope_theta}
        for key, field in _YARN_KEYS.items():
            value = getattr(c, field)
            if value is not None:
                params[key] = value
        out["rope_parameters"] = params
        # transformers 4.x reads YaRN from rope_scaling only (5.x reads it first)
        out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    return out
