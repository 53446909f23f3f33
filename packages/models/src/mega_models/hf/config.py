"""Hugging Face ``config.json`` <-> :class:`GPTConfig` for Llama-family decoders (Qwen3's
per-head q/k norms as ``GPTConfig.qk_norm``) and their mixtures of experts (Mixtral,
Qwen2-MoE, Qwen3-MoE; the expert keys are in :mod:`mega_models.hf.moe`), and DeepSeek-V3
(latent attention, its routing and MTP: :mod:`mega_models.hf.deepseek_v3`).

Pure dictionaries and dataclasses: no torch, no safetensors, no transformers. Both the
``transformers`` 4.x layout (``rope_theta``, ``rope_scaling``, ``torch_dtype``) and the
5.x one (``rope_parameters``, ``dtype``) are read; both are written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mega_models.config import GPTConfig
from mega_models.hf.deepseek_v3 import (
    DEEPSEEK_V3,
    check_deepseek_export,
    deepseek_fields_from_hf,
    hf_deepseek_keys,
)
from mega_models.hf.moe import (
    MIXTRAL,
    MOE_ARCHITECTURES,
    QWEN2_MOE,
    QWEN3_MOE,
    check_moe_export,
    hf_moe_keys,
    moe_fields_from_hf,
)

__all__ = [
    "HF_ARCHITECTURES",
    "HF_DEFAULTS",
    "OWNED_KEYS",
    "HFLayout",
    "check_base_config",
    "default_architecture",
    "gpt_config_from_hf",
    "hf_config_from_gpt",
    "hf_layout",
    "read_hf_config",
]

QWEN3 = "Qwen3ForCausalLM"
#: The architectures with per-head RMSNorm on q and k (``GPTConfig.qk_norm``).
QK_NORM_ARCHITECTURES = (QWEN3, QWEN3_MOE)

#: Architectures the bridge reads and writes, with their ``model_type``.
HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    QWEN3: "qwen3",
    MIXTRAL: "mixtral",
    QWEN2_MOE: "qwen2_moe",
    QWEN3_MOE: "qwen3_moe",
    DEEPSEEK_V3: "deepseek_v3",
}

HFSource = str | os.PathLike[str] | Mapping[str, Any]

#: What ``transformers`` takes for a key a config.json leaves out where the bridge's general
#: default would differ (the key's value when given, ``null`` included, always wins).
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    MIXTRAL: {"rms_norm_eps": 1e-5, "rope_theta": 1e6},
    QWEN3: {"head_dim": 128},
    QWEN2_MOE: {"shared_expert_intermediate_size": 5632},
    DEEPSEEK_V3: {
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
        "first_k_dense_replace": 3, "num_nextn_predict_layers": 1,
    },
}  # fmt: skip
#: Keys with no default worth taking: a config.json without one is refused.
_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
)  # fmt: skip


@dataclass(frozen=True)
class HFLayout:
    """Which Hugging Face architecture a checkpoint is, and which of its linears have biases."""

    architecture: str
    """One of :data:`HF_ARCHITECTURES`."""
    qkv_bias: bool
    """``q_proj``/``k_proj``/``v_proj`` have biases (Qwen2, Qwen2-MoE; Llama with
    ``attention_bias``)."""
    proj_bias: bool
    """``o_proj`` has a bias (Llama with ``attention_bias``)."""
    mlp_bias: bool
    """``gate_proj``/``up_proj``/``down_proj`` have biases (Llama with ``mlp_bias``)."""
    num_experts: int = 0
    """Routed experts of each sparse layer (Mixtral, Qwen2-MoE); 0 for a dense model."""
    qk_norm: bool = False
    """``self_attn.q_norm`` / ``k_norm`` scale each head before RoPE (Qwen3, Qwen3-MoE)."""
    mla: bool = False
    """Latent attention (DeepSeek-V3): ``q_a_proj``/``q_b_proj``, ``kv_a_proj_with_mqa``..."""
    q_lora: bool = False
    """MLA with a low-rank query (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``), not ``q_proj``."""
    rope_interleave: bool = False
    """MLA's rope rows are stored as interleaved pairs (DeepSeek's ``rope_interleave``)."""
    num_layers: int = 0
    """Decoder layers (DeepSeek-V3's MTP depth k is stored as layer ``num_layers + k``)."""

    @property
    def any_bias(self) -> bool:
        """True when some linear has a bias."""
        return self.qkv_bias or self.proj_bias or self.mlp_bias

    @property
    def add_bias(self) -> bool:
        """The mega model needs ``add_bias`` (a bias beyond q/k/v; the missing ones are zero)."""
        return self.proj_bias or self.mlp_bias


def read_hf_config(source: HFSource) -> dict[str, Any]:
    """The ``config.json`` of a model directory (or the mapping itself), as a plain dict."""
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(
            f"{file} does not exist; pass a Hugging Face model directory holding config.json"
        )
    with file.open(encoding="utf-8") as f:
        loaded = json.load(f)
    if not isinstance(loaded, dict):
        raise ValueError(f"{file} does not hold a JSON object; pass a Hugging Face config.json")
    return loaded


def _architecture(cfg: Mapping[str, Any]) -> str:
    names = cfg.get("architectures") or []
    name = names[0] if names else None
    if name is None:
        by_type = {v: k for k, v in HF_ARCHITECTURES.items()}
        name = by_type.get(str(cfg.get("model_type")), f"model_type {cfg.get('model_type')!r}")
    if name not in HF_ARCHITECTURES:
        raise ValueError(
            f"architecture {name} is not supported by the mega HF bridge; "
            f"supported: {', '.join(HF_ARCHITECTURES)}"
        )
    return str(name)


def _completed(cfg: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """``cfg`` with the keys it leaves out filled as ``transformers`` fills them
    (:data:`HF_DEFAULTS`); one sentence if a shape key is missing."""
    missing = [key for key in _REQUIRED if cfg.get(key) is None]
    if missing:
        raise ValueError(
            f"the {arch} config has no {', '.join(missing)}; pass the complete config.json "
            "the checkpoint was saved with"
        )
    return {**HF_DEFAULTS.get(arch, {}), **cfg}


def hf_layout(source: HFSource) -> HFLayout:
    """The architecture and bias layout of a Hugging Face config."""
    cfg = read_hf_config(source)
    arch = _architecture(cfg)
    cfg = _completed(cfg, arch)
    if arch == "Qwen2ForCausalLM":
        return HFLayout(arch, qkv_bias=True, proj_bias=False, mlp_bias=False)
    if arch == "LlamaForCausalLM":
        attn, mlp = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
        return HFLayout(arch, qkv_bias=attn, proj_bias=attn, mlp_bias=mlp)
    if arch == QWEN2_MOE:  # transformers 4.x always builds the q/k/v biases; 5.x asks qkv_bias
        experts = int(cfg.get("num_experts", 60))
        qkv = bool(cfg.get("qkv_bias", True))
        return HFLayout(arch, qkv_bias=qkv, proj_bias=False, mlp_bias=False, num_experts=experts)
    if arch == QWEN3:
        return HFLayout(arch, qkv_bias=False, proj_bias=False, mlp_bias=False, qk_norm=True)
    if arch == QWEN3_MOE:  # transformers 5 writes the count as num_local_experts
        experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 128)))
        return HFLayout(arch, False, False, False, num_experts=experts, qk_norm=True)
    if arch == MIXTRAL:
        experts = int(cfg.get("num_local_experts", cfg.get("num_experts", 8)))
        return HFLayout(arch, qkv_bias=False, proj_bias=False, mlp_bias=False, num_experts=experts)
    if arch == DEEPSEEK_V3:
        return HFLayout(
            arch, False, False, False,
            num_experts=int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 256))),
            mla=True, q_lora=cfg.get("q_lora_rank") is not None,
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            num_layers=int(cfg["num_hidden_layers"]),
        )  # fmt: skip
    return HFLayout(arch, qkv_bias=False, proj_bias=False, mlp_bias=False)


def _rope_dict(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE parameters as ``transformers`` 5 takes them: ``rope_scaling`` (the 4.x key)
    wins over ``rope_parameters`` when both are given."""
    return dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})


def _rope(cfg: Mapping[str, Any]) -> tuple[float, str]:
    """(theta, rope type) from either config layout."""
    params = _rope_dict(cfg)
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or params.get("type") or "default"
    return float(theta), str(kind)


def _window(cfg: Mapping[str, Any], arch: str) -> int | None:
    """The sliding-attention window the checkpoint uses, or None."""
    window = cfg.get("sliding_window")
    qwen = ("Qwen2ForCausalLM", QWEN2_MOE, QWEN3, QWEN3_MOE)
    if arch in qwen and not cfg.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def gpt_config_from_hf(source: HFSource) -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face checkpoint (its directory, config.json or dict).

    Unsupported checkpoints fail in one sentence naming the value: an unknown
    architecture, an activation other than SiLU, RoPE scaling, a head dim that is not
    ``hidden_size / num_attention_heads`` (except Qwen3 / Qwen3-MoE's explicit ``head_dim``,
    which gives ``kv_channels``), a router setting mega's router lacks (Mixtral's
    ``router_jitter_noise``). A sliding-attention window caps ``max_seq_len`` (mega attends
    over the whole causal context, which is the same up to the window). Q/K/V-only biases
    (Qwen2, Qwen2-MoE) give ``qkv_bias``; any other bias gives ``add_bias``. Qwen3 gives
    ``qk_norm``, and so does Qwen3-MoE; their ``attention_bias`` must be false (no Qwen3
    checkpoint has one). A key the config leaves out reads as ``transformers`` reads it
    (:data:`HF_DEFAULTS`: Mixtral's eps and theta, Qwen3's ``head_dim`` 128, DeepSeek-V3's
    ranks and routing); a config without one of the shape keys fails in one sentence.
    """
    cfg = read_hf_config(source)
    if (cfg.get("architectures") or [None])[0] == "NemotronHForCausalLM":  # HybridConfig
        from mega_models.hf.nemotron_h_config import nemotron_h_config_from_hf

        return nemotron_h_config_from_hf(cfg)
    layout = hf_layout(cfg)
    arch = layout.architecture
    cfg = _completed(cfg, arch)
    if arch in QK_NORM_ARCHITECTURES and cfg.get("attention_bias", False):
        raise ValueError(
            f"attention_bias ({cfg['attention_bias']!r}) of {arch} is not supported; "
            "mega converts Qwen3 without attention biases (set attention_bias to false)"
        )
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(
            f"hidden_act ({act!r}) of {arch} is not supported; GPTModel's SwiGLU uses silu"
        )
    theta, rope_type = _rope(cfg)
    if arch == DEEPSEEK_V3:
        return _deepseek_config(cfg, theta)
    if rope_type != "default":
        raise ValueError(
            f"RoPE scaling ({rope_type!r}) is not supported; GPTModel has plain RoPE only "
            "(use a checkpoint without rope_scaling)"
        )
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim")
    kv_channels = None  # an explicit head width (Qwen3-0.6B: 16 heads of 128 on 1024)
    if head_dim is not None and int(head_dim) * heads != hidden:
        if arch not in QK_NORM_ARCHITECTURES:
            raise ValueError(
                f"head_dim ({head_dim}) is not hidden_size / num_attention_heads ({hidden} / "
                f"{heads}); mega converts an explicit head_dim for {QWEN3} and {QWEN3_MOE} "
                "only, the others derive the head dim from the two"
            )
        kv_channels = int(head_dim)
    max_len = int(cfg.get("max_position_embeddings", 2048))
    window = _window(cfg, arch)
    if window is not None:
        max_len = min(max_len, window)
    kv = cfg.get("num_key_value_heads")
    moe = moe_fields_from_hf(cfg, arch) if arch in MOE_ARCHITECTURES else {}
    return GPTConfig(
        **_decoder_fields(cfg, theta, max_len),
        num_query_groups=None if kv is None else int(kv),
        kv_channels=kv_channels,
        qk_norm=layout.qk_norm,
        add_bias=layout.add_bias,
        qkv_bias=layout.qkv_bias and not layout.add_bias,
        **moe,
    )


def _decoder_fields(cfg: Mapping[str, Any], theta: float, max_len: int) -> dict[str, Any]:
    """The GPTConfig fields every Llama-family decoder (DeepSeek-V3 too) sets alike."""
    return {
        "vocab_size": int(cfg["vocab_size"]),
        "hidden_size": int(cfg["hidden_size"]),
        "num_layers": int(cfg["num_hidden_layers"]),
        "num_attention_heads": int(cfg["num_attention_heads"]),
        "ffn_hidden_size": int(cfg["intermediate_size"]),
        "norm": "rmsnorm",
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "activation": "swiglu",
        "position": "rope",
        "rope_theta": theta,
        "max_seq_len": max_len,
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "attention_dropout": float(cfg.get("attention_dropout", 0.0)),
        "init_std": float(cfg.get("initializer_range", 0.02)),
    }


def _deepseek_config(cfg: Mapping[str, Any], theta: float) -> GPTConfig:
    max_len = int(cfg.get("max_position_embeddings", 4096))
    return GPTConfig(**_decoder_fields(cfg, theta, max_len), **deepseek_fields_from_hf(cfg))


def check_convertible(config: GPTConfig) -> None:
    """Raise if ``config`` uses a feature no Llama-family checkpoint has."""
    for field, value, want in (
        ("norm", config.norm, "rmsnorm"),
        ("activation", config.activation, "swiglu"),
        ("position", config.position, "rope"),
    ):
        if value != want:
            raise ValueError(
                f"GPTConfig.{field} ({value!r}) has no Llama-family equivalent; "
                f"only {field}={want!r} converts to or from Hugging Face"
            )


def _check_llama_export(config: GPTConfig, architecture: str) -> None:
    """Standard attention and no MTP: all a Llama-family architecture stores."""
    if config.attention != "mha":
        raise ValueError(
            f"GPTConfig.attention ({config.attention!r}) cannot be written as {architecture}; "
            f"export latent-attention models as {DEEPSEEK_V3}"
        )
    if config.mtp_num_layers:
        raise ValueError(
            f"GPTConfig.mtp_num_layers ({config.mtp_num_layers}) cannot be written as "
            f"{architecture}, which has no MTP depths; export as {DEEPSEEK_V3}, or drop them "
            "with config.replace(mtp_num_layers=0)"
        )
    derived = config.hidden_size // config.num_attention_heads
    if config.head_dim != derived and architecture not in QK_NORM_ARCHITECTURES:
        raise ValueError(
            f"GPTConfig.kv_channels ({config.kv_channels}) is not hidden_size / "
            f"num_attention_heads ({derived}), which {architecture} derives the head dim from; "
            f"export as {QWEN3} / {QWEN3_MOE} (qk_norm), or leave kv_channels unset"
        )
    check_moe_export(config, architecture)
    _check_qwen3_export(config, architecture)


def _check_qwen3_export(config: GPTConfig, architecture: str) -> None:
    """qk_norm is written as Qwen3 / Qwen3-MoE and only as them, without biases."""
    qwen3 = architecture in QK_NORM_ARCHITECTURES
    if config.qk_norm != qwen3:
        raise ValueError(
            f"GPTConfig.qk_norm ({config.qk_norm}) cannot be written as {architecture}; "
            f"export qk_norm models as {QWEN3} (dense) or {QWEN3_MOE} and others as another "
            f"architecture (qk_norm={qwen3})"
        )
    if qwen3 and (config.add_bias or config.qkv_bias):
        raise ValueError(
            f"GPTConfig.add_bias ({config.add_bias}) / qkv_bias ({config.qkv_bias}) cannot be "
            f"written as {architecture}, which mega converts without biases; turn them off"
        )


def default_architecture(config: GPTConfig) -> str:
    """The architecture ``config`` is written as when none is asked for.

    Dense: ``Qwen3ForCausalLM`` with ``qk_norm``, ``Qwen2ForCausalLM`` with ``qkv_bias``,
    else ``LlamaForCausalLM``. MoE: ``Qwen3MoeForCausalLM`` with ``qk_norm``,
    ``MixtralForCausalLM`` when every layer is MoE, without shared expert and without
    ``qkv_bias``, else ``Qwen2MoeForCausalLM``.
    """
    if config.attention == "mla":
        return DEEPSEEK_V3
    if config.qk_norm:
        return QWEN3_MOE if config.is_moe else QWEN3
    if not config.is_moe:
        return "Qwen2ForCausalLM" if config.qkv_bias else "LlamaForCausalLM"
    everywhere = len(config.moe_layers) == config.num_layers
    if everywhere and not config.moe_shared_expert_size and not config.qkv_bias:
        return MIXTRAL
    return QWEN2_MOE


def hf_config_from_gpt(
    config: GPTConfig,
    architecture: str | None = None,
    *,
    dtype: str = "float32",
    base: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``config.json`` dict of ``config`` as ``architecture``.

    ``architecture`` defaults to ``base``'s, else to :func:`default_architecture`. ``base`` (e.g. the
    config.json the model came from) gives every key the export does not own, unchanged
    (token ids, ``use_cache``, ``max_window_layers``, the router's training keys...).

    The export owns the keys it derives from ``config`` (:data:`OWNED_KEYS`): the
    architecture, the shapes, the norm, RoPE, bias, window and expert keys, and ``dtype``
    / ``torch_dtype`` (the dtype of the tensors written). Even an owned key keeps
    ``base``'s value when that value reads back as the same model (Mistral's
    ``max_position_embeddings`` beyond its window, Qwen2's unused ``sliding_window``),
    so a model exported with the config it was imported from gets that config back,
    with ``dtype`` as written and ``rope_theta`` / ``torch_dtype`` added for
    transformers 4.x readers. A Llama model with
    ``add_bias`` is written with ``attention_bias`` and ``mlp_bias`` (``attention_bias``
    alone for ``qkv_bias``). An MoE model needs an MoE architecture and settings it can
    express, or this fails in one sentence naming the field.
    """
    check_convertible(config)
    if architecture is None:
        architecture = hf_layout(base).architecture if base else default_architecture(config)
    if architecture not in HF_ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture} is not supported by the mega HF bridge; "
            f"supported: {', '.join(HF_ARCHITECTURES)}"
        )
    if architecture == DEEPSEEK_V3:
        check_deepseek_export(config)
    else:
        _check_llama_export(config, architecture)
    out: dict[str, Any] = dict(base) if base is not None else {}
    out.pop("rope_scaling", None)
    out.update({
        "architectures": [architecture],
        "model_type": HF_ARCHITECTURES[architecture],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.init_std,
        "dtype": dtype,
        "torch_dtype": dtype,
    })  # fmt: skip
    if architecture in ("LlamaForCausalLM", "MistralForCausalLM", *QK_NORM_ARCHITECTURES):
        out["head_dim"] = config.head_dim  # Qwen3's default (128) is not hidden / heads
    elif out.get("head_dim") is not None:  # the others derive it unless it is given
        out["head_dim"] = config.head_dim
    if architecture in QK_NORM_ARCHITECTURES:
        out["attention_bias"] = False
    if architecture == "LlamaForCausalLM":
        out["attention_bias"] = config.add_bias or config.qkv_bias
        out["mlp_bias"] = config.add_bias
    if architecture in ("MistralForCausalLM", MIXTRAL):
        out.setdefault("sliding_window", None)
    if architecture in ("Qwen2ForCausalLM", *QK_NORM_ARCHITECTURES):
        out["use_sliding_window"] = False
        out["sliding_window"] = None
    if architecture in ("Qwen2ForCausalLM", QWEN2_MOE, QWEN3):
        out["layer_types"] = ["full_attention"] * config.num_layers
    if architecture in MOE_ARCHITECTURES:
        out.update(hf_moe_keys(config, architecture, out))
    if architecture == DEEPSEEK_V3:
        out.update(hf_deepseek_keys(config, out))
    if base is not None:
        _keep_base_spelling(out, base, config.num_layers)
        if "rope_scaling" not in base:  # a transformers 5 config: its readers take rope_parameters
            out.pop("rope_scaling", None)
    return out


#: Keys :func:`hf_config_from_gpt` derives from the GPTConfig (some only for some
#: architectures); every other key of a base config is written unchanged.
OWNED_KEYS = (
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_parameters", "rope_scaling", "tie_word_embeddings", "attention_dropout",
    "initializer_range", "attention_bias", "mlp_bias", "qkv_bias", "sliding_window",
    "use_sliding_window", "layer_types", "num_local_experts", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_jitter_noise",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "qk_head_dim", "rope_interleave", "n_routed_experts", "n_shared_experts",
    "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace",
    "moe_layer_freq", "scoring_func", "topk_method", "num_nextn_predict_layers",
    "dtype", "torch_dtype",
)  # fmt: skip
# owned keys that name what is written, not what is computed: never taken from the base
_WRITTEN = ("architectures", "model_type", "dtype", "torch_dtype")


def _keep_base_spelling(out: dict[str, Any], base: Mapping[str, Any], num_layers: int) -> None:
    """Put back each owned key of ``base`` whose value reads as the same model as ``out``'s.

    Keys interact (a window caps ``max_position_embeddings``), so this repeats until no
    key changes. ``layer_types`` (not read by the import) is kept when it has one entry
    per layer.
    """
    reference = (gpt_config_from_hf(out), hf_layout(out))
    changed = True
    while changed:
        changed = False
        for key in OWNED_KEYS:
            if key in _WRITTEN or key == "layer_types" or key not in base:
                continue
            if key in out and out[key] == base[key]:
                continue
            trial = {**out, key: base[key]}
            try:
                same = (gpt_config_from_hf(trial), hf_layout(trial)) == reference
            except (ValueError, TypeError, KeyError):
                same = False
            if same:
                out[key] = base[key]
                changed = True
    types = base.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers and "layer_types" in out:
        out["layer_types"] = types


#: The GPTConfig fields an HF config must agree on with the model exported with it.
_SHAPE_FIELDS = (
    "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "kv_heads",
    "ffn_size", "num_experts", "moe_ffn_size", "moe_layers", "tie_embeddings",
)  # fmt: skip


def check_base_config(config: GPTConfig, base: HFSource, way_out: str) -> None:
    """Raise, in one sentence ending with ``way_out``, if ``base`` (the config.json an
    export keeps the other keys of) describes a model of other dimensions than ``config``."""
    name = "the base config" if isinstance(base, Mapping) else str(base)
    theirs = gpt_config_from_hf(base)
    for field in _SHAPE_FIELDS:
        want, have = getattr(theirs, field), getattr(config, field)
        if want != have:
            raise ValueError(
                f"{name} describes a model with {field} {want} but the model to export has "
                f"{have}; {way_out}"
            )
