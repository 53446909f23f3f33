"""The attention settings of a GPTConfig checked together: MHA's head width, MLA's ranks and
head dims, DeepSeek's YaRN rope scaling. One sentence per bad value, at construction."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mega_models.config import GPTConfig

__all__ = ["MLA_FIELDS", "check_attention", "yarn_mscale"]

#: The fields only multi-head latent attention reads.
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_MLA_REQUIRED = MLA_FIELDS[1:]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} ({value!r}) must be a positive integer")


def check_attention(c: GPTConfig) -> None:
    """Raise one ``ValueError`` sentence for attention settings that cannot be built."""
    if c.attention not in ("mha", "mla"):
        raise ValueError(f"attention ({c.attention!r}) must be 'mha' or 'mla'")
    if c.kv_channels is not None:
        _positive_int("kv_channels", c.kv_channels)
        if c.attention == "mla":
            raise ValueError(
                f"kv_channels ({c.kv_channels}) sets the head width of standard attention; "
                "MLA's head widths are qk_nope_head_dim, qk_rope_head_dim and v_head_dim, so "
                "leave kv_channels unset"
            )
    _check_yarn(c)
    if c.attention == "mha":
        given = [n for n in MLA_FIELDS if getattr(c, n) is not None]
        if given:
            what = "is a setting" if len(given) == 1 else "are settings"
            raise ValueError(
                f"{', '.join(given)} {what} of multi-head latent attention; set attention = "
                f"'mla' or leave {'it' if len(given) == 1 else 'them'} unset"
            )
        return
    missing = [n for n in _MLA_REQUIRED if getattr(c, n) is None]
    if missing:
        raise ValueError(
            f"attention 'mla' needs {', '.join(missing)}; set them (DeepSeek-V3: "
            "kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128)"
        )
    for name in MLA_FIELDS:
        if getattr(c, name) is not None:
            _positive_int(name, getattr(c, name))
    if c.num_query_groups not in (None, c.num_attention_heads):
        raise ValueError(
            f"MLA gives every query head its own key and value, so num_query_groups "
            f"({c.num_query_groups}) must be unset or num_attention_heads "
            f"({c.num_attention_heads})"
        )
    if c.add_bias or c.qkv_bias:
        raise ValueError(
            "attention 'mla' has no biases on its projections (and add_bias would put them "
            "there); set add_bias and qkv_bias to false"
        )
    if c.qk_norm:
        raise ValueError(
            "attention 'mla' normalises its q and kv latents, not per-head q and k; set "
            "qk_norm to false"
        )
    if c.position != "rope":
        raise ValueError(
            f"attention 'mla' rotates its decoupled rope key, so position ({c.position!r}) "
            "must be 'rope'"
        )


def _check_yarn(c: GPTConfig) -> None:
    factor = c.rope_scaling_factor
    if factor is None:
        if c.rope_original_max_position is not None:
            raise ValueError(
                f"rope_original_max_position ({c.rope_original_max_position}) is a YaRN "
                "setting; set rope_scaling_factor too, or leave it unset"
            )
        return
    if c.attention != "mla":
        raise ValueError(
            f"rope_scaling_factor ({factor!r}) is DeepSeek's YaRN scaling, built for "
            "attention 'mla'; set attention = 'mla' or leave it unset"
        )
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor >= 1.0:
        raise ValueError(f"rope_scaling_factor ({factor!r}) must be a number >= 1, or None")
    if c.rope_original_max_position is None:
        raise ValueError(
            f"rope_scaling_factor ({factor}) needs rope_original_max_position, the context "
            "length before extension (DeepSeek-V3: 4096)"
        )
    _positive_int("rope_original_max_position", c.rope_original_max_position)
    if not c.rope_beta_fast > c.rope_beta_slow > 0:
        raise ValueError(
            f"YaRN needs rope_beta_fast ({c.rope_beta_fast}) > rope_beta_slow "
            f"({c.rope_beta_slow}) > 0 (DeepSeek-V3: 32 and 1)"
        )
    for name in ("rope_mscale", "rope_mscale_all_dim"):
        if not getattr(c, name) >= 0:
            raise ValueError(f"{name} ({getattr(c, name)!r}) must be >= 0")
