"""Names and layouts: which ``NemotronHForCausalLM`` tensors make each HybridModel parameter.

Pure tensor arithmetic, no files. Beside what the GPT mapping has (``vocab`` rows padded
to a multiple of tp, ``qkv`` fused by KV group), one layout differs: ``rows``. Hugging
Face keeps the Mamba-2 ``in_proj`` rows as ``z | x | B | C | dt`` over all groups and the
conv channels as ``x | B | C``; mega lays both out group by group (each group's z, x, B,
C, dt, resp. x, B, C) so that a tp split gives every rank whole groups. The two differ by
a fixed permutation of rows (:func:`in_proj_rows`, :func:`conv_rows`). The conv weight is
``[C, 1, k]`` there and ``[C, k]`` here.

Checkpoints keep their tensors under ``backbone.`` (what transformers writes and NVIDIA's
checkpoints hold); ``model.`` is read as well.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from mega_models.hybrid_config import HybridConfig

__all__ = [
    "HybridTensorMap",
    "conv_rows",
    "hybrid_parameter_names",
    "hybrid_tensor_map",
    "in_proj_rows",
    "nemotron_h_tensor_names",
]

Kind = Literal["copy", "vocab", "qkv", "rows"]

BACKBONE = "backbone."
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_PER_LAYER: dict[str, tuple[Kind, tuple[str, ...]]] = {
    "norm.weight": ("copy", ("norm.weight",)),
    "mamba.in_proj.weight": ("rows", ("mixer.in_proj.weight",)),
    "mamba.conv_weight": ("rows", ("mixer.conv1d.weight",)),
    "mamba.conv_bias": ("rows", ("mixer.conv1d.bias",)),
    "mamba.dt_bias": ("copy", ("mixer.dt_bias",)),
    "mamba.A_log": ("copy", ("mixer.A_log",)),
    "mamba.D": ("copy", ("mixer.D",)),
    "mamba.norm_weight": ("copy", ("mixer.norm.weight",)),
    "mamba.out_proj.weight": ("copy", ("mixer.out_proj.weight",)),
    "attention.qkv.weight": (
        "qkv",
        ("mixer.q_proj.weight", "mixer.k_proj.weight", "mixer.v_proj.weight"),
    ),
    "attention.proj.weight": ("copy", ("mixer.o_proj.weight",)),
    "mlp.fc1.weight": ("copy", ("mixer.up_proj.weight",)),
    "mlp.fc2.weight": ("copy", ("mixer.down_proj.weight",)),
}
_KIND_PARAMS = {
    "M": ("mamba.in_proj.weight", "mamba.conv_weight", "mamba.conv_bias", "mamba.dt_bias",
          "mamba.A_log", "mamba.D", "mamba.norm_weight", "mamba.out_proj.weight"),
    "*": ("attention.qkv.weight", "attention.proj.weight"),
    "-": ("mlp.fc1.weight", "mlp.fc2.weight"),
}  # fmt: skip


@dataclass(frozen=True)
class HybridTensorMap:
    """How one HybridModel parameter is made of Hugging Face tensors."""

    mega: str
    """The parameter's name in ``HybridModel.named_parameters()`` (global layer index)."""
    kind: Kind
    """``copy``, ``vocab`` (padded rows), ``qkv`` (fused by KV group) or ``rows`` (a
    permutation of one tensor's rows: ``hf_rows``)."""
    hf: tuple[str, ...]
    """The Hugging Face tensor names, q/k/v in that order for ``qkv``."""
    shapes: tuple[tuple[int, ...], ...]
    """The full shape each of ``hf`` must have."""


def in_proj_rows(config: HybridConfig) -> Tensor:
    """``perm`` with mega's ``in_proj`` row ``i`` = Hugging Face's row ``perm[i]``."""
    c = config
    inner, gn, g = c.mamba_inner, c.mamba_num_groups * c.mamba_state_dim, c.mamba_num_groups
    rows = torch.arange(2 * inner + 2 * gn + c.mamba_num_heads)
    parts = torch.split(rows, [inner, inner, gn, gn, c.mamba_num_heads])  # z, x, B, C, dt
    return torch.cat([p.view(g, -1) for p in parts], dim=1).reshape(-1)


def conv_rows(config: HybridConfig) -> Tensor:
    """``perm`` with mega's conv channel ``i`` = Hugging Face's channel ``perm[i]``."""
    c = config
    inner, gn, g = c.mamba_inner, c.mamba_num_groups * c.mamba_state_dim, c.mamba_num_groups
    parts = torch.split(torch.arange(inner + 2 * gn), [inner, gn, gn])  # x, B, C
    return torch.cat([p.view(g, -1) for p in parts], dim=1).reshape(-1)


def _shapes(suffix: str, c: HybridConfig) -> tuple[tuple[int, ...], ...]:
    h, d, f = c.hidden_size, c.head_dim, c.ffn_size
    inner, heads = c.mamba_inner, c.mamba_num_heads
    conv = inner + 2 * c.mamba_num_groups * c.mamba_state_dim
    q, kv = c.num_attention_heads * d, c.kv_heads * d
    shapes: dict[str, tuple[tuple[int, ...], ...]] = {
        "norm.weight": ((h,),),
        "mamba.in_proj.weight": ((inner + conv + heads, h),),
        "mamba.conv_weight": ((conv, 1, c.mamba_conv_width),),
        "mamba.conv_bias": ((conv,),),
        "mamba.dt_bias": ((heads,),), "mamba.A_log": ((heads,),), "mamba.D": ((heads,),),
        "mamba.norm_weight": ((inner,),),
        "mamba.out_proj.weight": ((h, inner),),
        "attention.qkv.weight": ((q, h), (kv, h), (kv, h)),
        "attention.proj.weight": ((h, q),),
        "mlp.fc1.weight": ((f, h),),
        "mlp.fc2.weight": ((h, f),),
    }  # fmt: skip
    return shapes[suffix]


def hybrid_tensor_map(
    mega_name: str, config: HybridConfig, prefix: str = BACKBONE
) -> HybridTensorMap:
    """The :class:`HybridTensorMap` of one HybridModel parameter; ``prefix`` is the
    checkpoint's (``backbone.`` or ``model.``)."""
    c = config
    vocab = ((c.vocab_size, c.hidden_size),)
    if mega_name == "embedding.word.weight":
        return HybridTensorMap(mega_name, "vocab", (f"{prefix}embeddings.weight",), vocab)
    if mega_name == "output.weight":
        return HybridTensorMap(mega_name, "vocab", ("lm_head.weight",), vocab)
    if mega_name == "final_norm.weight":
        return HybridTensorMap(mega_name, "copy", (f"{prefix}norm_f.weight",),
                               ((c.hidden_size,),))  # fmt: skip
    match = _LAYER.fullmatch(mega_name)
    if match is None or match.group(2) not in _PER_LAYER:
        raise ValueError(
            f"parameter {mega_name} has no NemotronHForCausalLM counterpart; only HybridModels "
            "of Mamba-2, attention and relu2 MLP layers without biases convert"
        )
    layer, suffix = match.groups()
    kind, names = _PER_LAYER[suffix]
    hf = tuple(f"{prefix}layers.{layer}.{n}" for n in names)
    return HybridTensorMap(mega_name, kind, hf, _shapes(suffix, c))


def hybrid_parameter_names(config: HybridConfig) -> list[str]:
    """The full-model parameter names of a HybridModel of ``config`` (no biases but the conv's)."""
    names = ["embedding.word.weight"]
    for i, kind in enumerate(config.pattern):
        own = [s for s in _KIND_PARAMS[kind] if s != "mamba.conv_bias" or config.mamba_conv_bias]
        names += [f"layers.{i}.norm.weight"] + [f"layers.{i}.{s}" for s in own]
    names.append("final_norm.weight")
    if not config.tie_embeddings:
        names.append("output.weight")
    return names


def nemotron_h_tensor_names(config: HybridConfig) -> list[str]:
    """Every tensor a ``NemotronHForCausalLM`` checkpoint of ``config`` holds (``lm_head``
    included even for a tied model: transformers ties nothing)."""
    names = [hybrid_tensor_map(n, config).hf for n in hybrid_parameter_names(config)]
    flat = [n for group in names for n in group]
    return flat if "lm_head.weight" in flat else [*flat, "lm_head.weight"]
