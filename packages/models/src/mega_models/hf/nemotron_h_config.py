"""Nemotron-H ``config.json`` <-> :class:`HybridConfig` (``NemotronHForCausalLM``).

Pure dictionaries, no torch. What ``transformers`` (5.x) computes from each key:

* ``layers_block_type`` (or the older ``hybrid_override_pattern`` string, or
  ``layer_types``): ``linear_attention`` is a Mamba-2 mixer (``M``), ``full_attention``
  self-attention without positions (``*``, ``position="none"``), ``mlp`` a squared-ReLU
  MLP without gate (``-``, ``activation="relu2"``). One pre-RMSNorm per block
  (``layer_norm_epsilon``), a final ``norm_f``, an output layer never tied to the embedding
  (``NemotronHForCausalLM`` ties nothing, whatever ``tie_word_embeddings`` says).
* Attention: ``head_dim`` (default 128; ``kv_channels`` when it is not ``hidden_size /
  num_attention_heads``); q/k/v/o never have biases (``attention_bias`` is not read).
* Mamba-2: inner width ``mamba_num_heads * mamba_head_dim``, ``n_groups`` groups of
  ``ssm_state_size`` state channels, a causal conv of ``conv_kernel`` over x‖B‖C with
  ``use_conv_bias``, ``dt = softplus(dt + dt_bias)`` clamped to ``(time_step_min, inf)``
  (``time_step_limit`` is not read), the ``D`` skip, an RMSNorm gated by ``silu(z)`` per
  group, ``use_bias`` on in_proj/out_proj; ``chunk_size`` steps per scan chunk.

Not supported, refused in one sentence: MoE blocks, multi-token prediction layers,
``use_bias`` / ``mlp_bias``, a sliding window, activations other than relu2 / silu.
Residuals stay in the model dtype, as transformers 5
computes them (``residual_in_fp32`` is kept in the config but read by neither side).
Every key this module does not own (:data:`NEMOTRON_H_OWNED_KEYS`) is kept from the
config.json the model came from.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mega_models.hybrid_config import HybridConfig

__all__ = [
    "NEMOTRON_H",
    "NEMOTRON_H_OWNED_KEYS",
    "check_nemotron_h_convertible",
    "hf_config_from_nemotron_h",
    "nemotron_h_config_from_hf",
]

NEMOTRON_H = "NemotronHForCausalLM"
_MODEL_TYPE = "nemotron_h"
_BLOCKS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
_LETTERS = {v: k for k, v in _BLOCKS.items()}
_DEFAULT_BLOCKS = ["linear_attention", "moe", "full_attention", "mlp"]  # transformers' default
# older spellings transformers still reads (they win over the new key when both are given)
_ALIASES = {
    "mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max",
    "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}  # fmt: skip

#: Keys :func:`hf_config_from_nemotron_h` derives from the HybridConfig; every other key of
#: a base config is written unchanged.
NEMOTRON_H_OWNED_KEYS = (
    "architectures", "model_type", "vocab_size", "hidden_size", "layers_block_type",
    "hybrid_override_pattern", "layer_types", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "attention_head_dim", "max_position_embeddings",
    "attention_dropout", "intermediate_size", "mlp_hidden_act", "mamba_hidden_act",
    "ssm_state_size", "mamba_num_heads", "mamba_head_dim", "n_groups", "conv_kernel", "expand",
    "time_step_min", "time_step_max", "time_step_floor", "use_conv_bias", "chunk_size",
    "use_bias", "mlp_bias", "initializer_range", "layer_norm_epsilon", "dtype", "torch_dtype",
    *_ALIASES,
)  # fmt: skip


def _get(cfg: Mapping[str, Any], key: str, default: Any) -> Any:
    """``cfg[key]`` as transformers reads it: an older alias wins, then the key, then the default."""
    for alias, name in _ALIASES.items():
        if name == key and alias in cfg:
            return cfg[alias]
    return cfg.get(key, default)


def _pattern(cfg: Mapping[str, Any]) -> str:
    blocks = cfg.get("layers_block_type", cfg.get("layer_types"))
    if blocks is None and isinstance(cfg.get("hybrid_override_pattern"), str):
        return str(cfg["hybrid_override_pattern"])
    blocks = _DEFAULT_BLOCKS if blocks is None else blocks
    if not isinstance(blocks, list) or any(b not in _BLOCKS for b in blocks):
        raise ValueError(
            f"layers_block_type ({blocks!r}) of {NEMOTRON_H} must be a list of "
            f"{', '.join(map(repr, _BLOCKS))}"
        )
    return "".join(_BLOCKS[b] for b in blocks)


def _refuse(cfg: Mapping[str, Any], pattern: str) -> None:
    """One sentence for each option mega cannot compute as transformers does."""
    if "E" in pattern:
        raise ValueError(
            f"{NEMOTRON_H} MoE blocks ('moe' at layer {pattern.index('E')}) are not supported "
            "by the mega bridge; convert dense Nemotron-H checkpoints (mamba, attention, mlp)"
        )
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if cfg.get(key, want) != want:
            raise ValueError(
                f"{key} ({cfg[key]!r}) of {NEMOTRON_H} is not supported; mega computes "
                f"{want!r} there"
            )
    for key in ("use_bias", "mlp_bias"):
        if cfg.get(key, False):
            raise ValueError(
                f"{key} ({cfg[key]!r}) of {NEMOTRON_H} is not supported; mega converts "
                "Nemotron-H without linear biases (set it to false)"
            )
    if int(cfg.get("num_nextn_predict_layers") or 0):
        raise ValueError(
            f"num_nextn_predict_layers ({cfg['num_nextn_predict_layers']!r}) of {NEMOTRON_H} "
            "is not supported; convert a checkpoint without multi-token prediction layers (0)"
        )
    if cfg.get("sliding_window") is not None:
        raise ValueError(
            f"sliding_window ({cfg['sliding_window']!r}) of {NEMOTRON_H} is not supported; "
            "mega's attention is causal over the whole sequence (set it to null)"
        )


def nemotron_h_config_from_hf(cfg: Mapping[str, Any]) -> HybridConfig:
    """The :class:`HybridConfig` of a Nemotron-H ``config.json`` dict (see the module doc)."""
    names = cfg.get("architectures") or [NEMOTRON_H]
    if names[0] != NEMOTRON_H:
        raise ValueError(f"architecture {names[0]} is not {NEMOTRON_H}; pass a Nemotron-H config")
    pattern = _pattern(cfg)
    _refuse(cfg, pattern)
    hidden, heads = int(cfg.get("hidden_size", 4096)), int(cfg.get("num_attention_heads", 32))
    head_dim = int(cfg.get("head_dim", cfg.get("attention_head_dim", 128)))
    expand = int(_get(cfg, "expand", 2))
    inner = int(cfg.get("mamba_num_heads", 128)) * int(cfg.get("mamba_head_dim", 64))
    dt_min = float(_get(cfg, "time_step_min", 0.001))
    kv = cfg.get("num_key_value_heads", 8)  # transformers' default when the key is absent
    try:
        return HybridConfig(
            vocab_size=int(cfg.get("vocab_size", 131072)), hidden_size=hidden,
            num_layers=len(pattern), pattern=pattern, num_attention_heads=heads,
            num_query_groups=heads if kv is None else int(kv),
            kv_channels=None if head_dim * heads == hidden else head_dim,
            ffn_hidden_size=int(cfg.get("intermediate_size", 21504)), norm="rmsnorm",
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), activation="relu2",
            position="none", max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
            tie_embeddings=False, add_bias=False,
            attention_dropout=float(cfg.get("attention_dropout", 0.0)),
            init_std=float(cfg.get("initializer_range", 0.02)),
            mamba_state_dim=int(cfg.get("ssm_state_size", 128)),
            mamba_head_dim=int(cfg.get("mamba_head_dim", 64)),
            mamba_num_groups=int(_get(cfg, "n_groups", 8)), mamba_expand=expand,
            mamba_inner_size=None if inner == expand * hidden else inner,
            mamba_conv_width=int(_get(cfg, "conv_kernel", 4)),
            mamba_chunk_size=int(_get(cfg, "chunk_size", 128)),
            mamba_dt_min=dt_min, mamba_dt_max=float(_get(cfg, "time_step_max", 0.1)),
            mamba_dt_init_floor=float(_get(cfg, "time_step_floor", 1e-4)),
            mamba_dt_limit=(dt_min, math.inf),
            mamba_conv_bias=bool(_get(cfg, "use_conv_bias", True)),
        )  # fmt: skip
    except ValueError as exc:
        raise ValueError(f"{NEMOTRON_H} config does not make a mega model: {exc}") from None


def check_nemotron_h_convertible(config: HybridConfig) -> None:
    """Raise, in one sentence naming the field, if ``config`` is no Nemotron-H model."""
    for field, value, want in (
        ("norm", config.norm, "rmsnorm"), ("activation", config.activation, "relu2"),
        ("position", config.position, "none"), ("add_bias", config.add_bias, False),
        ("qkv_bias", config.qkv_bias, False), ("qk_norm", config.qk_norm, False),
        ("mtp_num_layers", config.mtp_num_layers, 0),
    ):  # fmt: skip
        if value != want:
            raise ValueError(
                f"HybridConfig.{field} ({value!r}) has no {NEMOTRON_H} equivalent; only "
                f"{field}={want!r} converts to or from Hugging Face"
            )
    if "E" in config.pattern:
        raise ValueError(
            f"pattern {config.pattern!r} has MoE layers, which the mega bridge does not write "
            f"as {NEMOTRON_H}; convert dense patterns of 'M', '*' and '-'"
        )
    limit = (config.mamba_dt_min, math.inf)
    if tuple(config.mamba_dt_limit) != limit:
        raise ValueError(
            f"HybridConfig.mamba_dt_limit {tuple(config.mamba_dt_limit)} is not {limit}: "
            f"{NEMOTRON_H} clamps dt to (time_step_min, inf); set mamba_dt_limit to "
            "(mamba_dt_min, inf)"
        )


def hf_config_from_nemotron_h(
    config: HybridConfig, *, dtype: str = "float32", base: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``config.json`` dict of ``config`` as ``NemotronHForCausalLM``.

    ``base`` (the config.json the model came from) gives every key the export does not own
    unchanged (token ids, ``use_cache``, ``time_step_limit``, ``residual_in_fp32``, the MoE
    and MTP keys of a dense model...); the owned keys are derived from ``config``, in each
    spelling ``base`` used (``hybrid_override_pattern``, ``num_hidden_layers``, the
    ``mamba_*`` aliases), so what was imported reads back as the same config.
    """
    check_nemotron_h_convertible(config)
    c = config
    blocks = [_LETTERS[ch] for ch in c.pattern]
    owned: dict[str, Any] = {
        "architectures": [NEMOTRON_H], "model_type": _MODEL_TYPE, "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "layers_block_type": blocks,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim, "max_position_embeddings": c.max_seq_len,
        "attention_dropout": c.attention_dropout, "intermediate_size": c.ffn_size,
        "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu",
        "ssm_state_size": c.mamba_state_dim, "mamba_num_heads": c.mamba_num_heads,
        "mamba_head_dim": c.mamba_head_dim, "n_groups": c.mamba_num_groups,
        "conv_kernel": c.mamba_conv_width, "expand": c.mamba_expand,
        "time_step_min": c.mamba_dt_min, "time_step_max": c.mamba_dt_max,
        "time_step_floor": c.mamba_dt_init_floor, "use_conv_bias": c.mamba_conv_bias,
        "chunk_size": c.mamba_chunk_size, "use_bias": False, "mlp_bias": False,
        "initializer_range": c.init_std, "layer_norm_epsilon": c.norm_eps, "dtype": dtype,
    }  # fmt: skip
    out: dict[str, Any] = dict(base) if base is not None else {}
    if base is None:  # the output layer is written whole either way
        out["tie_word_embeddings"] = c.tie_embeddings
    present = set(out)
    out.update(owned)
    legacy = {"hybrid_override_pattern": c.pattern, "layer_types": blocks,
              "num_hidden_layers": c.num_layers, "attention_head_dim": c.head_dim,
              "torch_dtype": dtype}  # fmt: skip
    legacy.update({alias: owned[name] for alias, name in _ALIASES.items()})
    out.update({k: v for k, v in legacy.items() if k in present})
    renamed = {**_ALIASES, "hybrid_override_pattern": "layers_block_type",
               "layer_types": "layers_block_type"}  # fmt: skip
    for old, new in renamed.items():  # base spelled it the old way only: keep that spelling
        if old in present and new not in present:
            out.pop(new, None)
    return out
