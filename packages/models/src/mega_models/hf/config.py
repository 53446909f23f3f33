"""Hugging Face ``config.json`` <-> :class:`GPTConfig` for dense Llama-family decoders.

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

__all__ = [
    "HF_ARCHITECTURES",
    "HFLayout",
    "gpt_config_from_hf",
    "hf_config_from_gpt",
    "hf_layout",
    "read_hf_config",
]

#: Dense architectures the bridge reads and writes, with their ``model_type``.
HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_MOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

HFSource = str | os.PathLike[str] | Mapping[str, Any]


@dataclass(frozen=True)
class HFLayout:
    """Which Hugging Face architecture a checkpoint is, and which of its linears have biases."""

    architecture: str
    """``LlamaForCausalLM``, ``MistralForCausalLM`` or ``Qwen2ForCausalLM``."""
    qkv_bias: bool
    """``q_proj``/``k_proj``/``v_proj`` have biases (Qwen2; Llama with ``attention_bias``)."""
    proj_bias: bool
    """``o_proj`` has a bias (Llama with ``attention_bias``)."""
    mlp_bias: bool
    """``gate_proj``/``up_proj``/``down_proj`` have biases (Llama with ``mlp_bias``)."""

    @property
    def any_bias(self) -> bool:
        """True when the mega model needs ``add_bias`` (missing biases are then zero)."""
        return self.qkv_bias or self.proj_bias or self.mlp_bias


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
    if name in _MOE:
        raise ValueError(
            f"architecture {name} is a mixture of experts, which the mega HF bridge does not "
            f"convert yet; supported: {', '.join(HF_ARCHITECTURES)}"
        )
    if name not in HF_ARCHITECTURES:
        raise ValueError(
            f"architecture {name} is not supported by the mega HF bridge; "
            f"supported: {', '.join(HF_ARCHITECTURES)}"
        )
    return str(name)


def hf_layout(source: HFSource) -> HFLayout:
    """The architecture and bias layout of a Hugging Face config."""
    cfg = read_hf_config(source)
    arch = _architecture(cfg)
    if arch == "Qwen2ForCausalLM":
        return HFLayout(arch, qkv_bias=True, proj_bias=False, mlp_bias=False)
    if arch == "LlamaForCausalLM":
        attn, mlp = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
        return HFLayout(arch, qkv_bias=attn, proj_bias=attn, mlp_bias=mlp)
    return HFLayout(arch, qkv_bias=False, proj_bias=False, mlp_bias=False)


def _rope(cfg: Mapping[str, Any]) -> tuple[float, str]:
    """(theta, rope type) from either config layout."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), str(kind)


def _window(cfg: Mapping[str, Any], arch: str) -> int | None:
    """The sliding-attention window the checkpoint uses, or None."""
    window = cfg.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
        return None
    return int(window) if window is not None else None


def gpt_config_from_hf(source: HFSource) -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face checkpoint (its directory, config.json or dict).

    Unsupported checkpoints fail in one sentence naming the value: an unknown or MoE
    architecture, an activation other than SiLU, RoPE scaling, a head dim that is not
    ``hidden_size / num_attention_heads``. A sliding-attention window caps ``max_seq_len``
    (mega attends over the whole causal context, which is the same up to the window).
    """
    cfg = read_hf_config(source)
    layout = hf_layout(cfg)
    arch = layout.architecture
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(
            f"hidden_act ({act!r}) of {arch} is not supported; GPTModel's SwiGLU uses silu"
        )
    theta, rope_type = _rope(cfg)
    if rope_type != "default":
        raise ValueError(
            f"RoPE scaling ({rope_type!r}) is not supported; GPTModel has plain RoPE only "
            "(use a checkpoint without rope_scaling)"
        )
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != hidden:
        raise ValueError(
            f"head_dim ({head_dim}) is not hidden_size / num_attention_heads ({hidden} / "
            f"{heads}); GPTModel derives the head dim from them"
        )
    max_len = int(cfg.get("max_position_embeddings", 2048))
    window = _window(cfg, arch)
    if window is not None:
        max_len = min(max_len, window)
    kv = cfg.get("num_key_value_heads")
    return GPTConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_query_groups=None if kv is None else int(kv),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        norm="rmsnorm",
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        activation="swiglu",
        position="rope",
        rope_theta=theta,
        max_seq_len=max_len,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        add_bias=layout.any_bias,
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        init_std=float(cfg.get("initializer_range", 0.02)),
    )


def check_convertible(config: GPTConfig) -> None:
    """Raise if ``config`` uses a feature no Llama-family checkpoint has."""
    for field, value, want in (
        ("norm", config.norm, "rmsnorm"),
        ("activation", config.activation, "swiglu"),
        ("position", config.position, "rope"),
        ("qk_norm", config.qk_norm, False),
    ):
        if value != want:
            raise ValueError(
                f"GPTConfig.{field} ({value!r}) has no Llama-family equivalent; "
                f"only {field}={want!r} converts to or from Hugging Face"
            )


def hf_config_from_gpt(
    config: GPTConfig,
    architecture: str = "LlamaForCausalLM",
    *,
    dtype: str = "float32",
    base: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``config.json`` dict of ``config`` as ``architecture``.

    ``base`` (e.g. the config.json the model came from) keeps its other keys (token ids,
    ``layer_types``...); the shape keys are overwritten. A Llama model with ``add_bias``
    is written with ``attention_bias`` and ``mlp_bias``.
    """
    check_convertible(config)
    if architecture not in HF_ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture} is not supported by the mega HF bridge; "
            f"supported: {', '.join(HF_ARCHITECTURES)}"
        )
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
    if architecture in ("LlamaForCausalLM", "MistralForCausalLM"):
        out["head_dim"] = config.head_dim
    if architecture == "LlamaForCausalLM":
        out["attention_bias"] = config.add_bias
        out["mlp_bias"] = config.add_bias
    if architecture == "MistralForCausalLM":
        out.setdefault("sliding_window", None)
    if architecture == "Qwen2ForCausalLM":
        out["use_sliding_window"] = False
        out["sliding_window"] = None
        out["layer_types"] = ["full_attention"] * config.num_layers
    return out
