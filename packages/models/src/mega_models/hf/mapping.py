"""Names and layouts: which Hugging Face tensors make each GPTModel parameter, and how.

Pure tensor arithmetic, no files. Three layouts differ between the two sides:

* ``qkv`` — HF keeps ``q_proj``, ``k_proj``, ``v_proj``; mega fuses them grouped by KV
  head (for each group: its query heads, its key head, its value head).
* ``gate_up`` — HF keeps ``gate_proj`` and ``up_proj``; mega's SwiGLU ``fc1`` interleaves
  their rows one by one (gate_0, up_0, gate_1, up_1, ...).
* ``vocab`` — mega pads the vocabulary rows to a multiple of tp with zeros.

RoPE needs no permutation: HF-format Llama weights already use the rotate-half
convention that :func:`mega_models.rope.apply_rope` uses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from mega_models.config import GPTConfig
from mega_models.hf.config import HFLayout

__all__ = [
    "TensorMap",
    "fuse_qkv",
    "hf_shapes",
    "hf_tensor_names",
    "interleave_gate_up",
    "split_gate_up",
    "split_qkv",
    "tensor_map",
]

Kind = Literal["copy", "vocab", "qkv", "gate_up", "absent"]

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = "model.layers.{i}."
_PER_LAYER: dict[str, tuple[Kind, tuple[str, ...]]] = {
    "input_norm.weight": ("copy", ("input_layernorm.weight",)),
    "mlp_norm.weight": ("copy", ("post_attention_layernorm.weight",)),
    "attention.qkv.weight": (
        "qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    "attention.qkv.bias": (
        "qkv",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
    "attention.proj.weight": ("copy", ("self_attn.o_proj.weight",)),
    "attention.proj.bias": ("copy", ("self_attn.o_proj.bias",)),
    "mlp.fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.fc1.bias": ("gate_up", ("mlp.gate_proj.bias", "mlp.up_proj.bias")),
    "mlp.fc2.weight": ("copy", ("mlp.down_proj.weight",)),
    "mlp.fc2.bias": ("copy", ("mlp.down_proj.bias",)),
}
_TOP: dict[str, tuple[Kind, tuple[str, ...]]] = {
    "embedding.word.weight": ("vocab", ("model.embed_tokens.weight",)),
    "output.weight": ("vocab", ("lm_head.weight",)),
    "final_norm.weight": ("copy", ("model.norm.weight",)),
}


@dataclass(frozen=True)
class TensorMap:
    """How one GPTModel parameter is made of Hugging Face tensors."""

    mega: str
    """The parameter's name in ``GPTModel.named_parameters()``."""
    kind: Kind
    """``copy``, ``vocab`` (padded rows), ``qkv``, ``gate_up``, or ``absent`` (zero in mega)."""
    hf: tuple[str, ...]
    """The Hugging Face tensor names, in the order the kind fuses them (empty if absent)."""


def _has_bias(suffix: str, layout: HFLayout) -> bool:
    if suffix == "attention.qkv.bias":
        return layout.qkv_bias
    if suffix == "attention.proj.bias":
        return layout.proj_bias
    return layout.mlp_bias


def tensor_map(mega_name: str, layout: HFLayout) -> TensorMap:
    """The :class:`TensorMap` of one GPTModel parameter name (global layer index)."""
    if mega_name in _TOP:
        kind, hf = _TOP[mega_name]
        return TensorMap(mega_name, kind, hf)
    match = _LAYER.fullmatch(mega_name)
    if match is None or match.group(2) not in _PER_LAYER:
        raise ValueError(
            f"parameter {mega_name} has no Hugging Face counterpart; only GPTModels with "
            "rmsnorm, swiglu, rope and no qk_norm convert"
        )
    layer, suffix = match.groups()
    kind, hf = _PER_LAYER[suffix]
    if suffix.endswith(".bias") and not _has_bias(suffix, layout):
        return TensorMap(mega_name, "absent", ())
    prefix = _HF_LAYER.format(i=layer)
    return TensorMap(mega_name, kind, tuple(prefix + name for name in hf))


def hf_shapes(tmap: TensorMap, config: GPTConfig) -> tuple[tuple[int, ...], ...]:
    """The full shapes the Hugging Face tensors of ``tmap`` must have under ``config``."""
    c = config
    h, d, f = c.hidden_size, c.head_dim, c.ffn_size
    q, kv = c.num_attention_heads * d, c.kv_heads * d
    bias = tmap.mega.endswith(".bias")

    def shape(rows: int, cols: int) -> tuple[int, ...]:
        return (rows,) if bias else (rows, cols)

    suffix = tmap.mega.split(".", 2)[-1] if tmap.mega.startswith("layers.") else tmap.mega
    if tmap.kind == "vocab":
        return ((c.vocab_size, h),)
    if tmap.kind == "qkv":
        return (shape(q, h), shape(kv, h), shape(kv, h))
    if tmap.kind == "gate_up":
        return (shape(f, h), shape(f, h))
    if suffix == "attention.proj.weight":
        return ((h, q),)
    if suffix == "mlp.fc2.weight":
        return ((h, f),)
    return ((h,),)  # norms and the row-parallel biases


def hf_tensor_names(config: GPTConfig, layout: HFLayout) -> list[str]:
    """Every tensor a Hugging Face checkpoint of ``config`` holds, in file order."""
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_layers):
        for suffix in _PER_LAYER:
            tmap = tensor_map(f"layers.{i}.{suffix}", layout)
            if tmap.kind != "absent":
                names.extend(tmap.hf)
    names.append("model.norm.weight")
    if not config.tie_embeddings:
        names.append("lm_head.weight")
    return names


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, kv_heads: int) -> Tensor:
    """``q [n d, ...]``, ``k``/``v`` ``[kv d, ...]`` -> mega's grouped ``[(n + 2 kv) d, ...]``.

    Works on any run of whole KV groups (a tp shard: ``kv_heads`` is then the local count).
    """
    rest = q.shape[1:]
    q = q.reshape(kv_heads, -1, *rest)  # [kv, (n/kv) d, ...]
    k = k.reshape(kv_heads, -1, *rest)  # [kv, d, ...]
    v = v.reshape(kv_heads, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: Tensor, num_heads: int, kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """The inverse of :func:`fuse_qkv`: mega's fused rows -> contiguous ``q``, ``k``, ``v``."""
    rest = qkv.shape[1:]
    per_group = num_heads // kv_heads
    grouped = qkv.reshape(kv_heads, per_group + 2, -1, *rest)  # [kv, n/kv + 2, d, ...]
    q = grouped[:, :per_group].reshape(-1, *rest).contiguous()
    k = grouped[:, per_group].reshape(-1, *rest).contiguous()
    v = grouped[:, per_group + 1].reshape(-1, *rest).contiguous()
    return q, k, v


def interleave_gate_up(gate: Tensor, up: Tensor) -> Tensor:
    """``gate``, ``up`` ``[f, ...]`` -> mega's ``fc1`` rows ``[2 f, ...]`` (gate_0, up_0, ...)."""
    return torch.stack([gate, up], dim=1).reshape(-1, *gate.shape[1:])


def split_gate_up(fc1: Tensor) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`interleave_gate_up`: contiguous ``gate`` and ``up``."""
    pairs = fc1.reshape(-1, 2, *fc1.shape[1:])  # [f, 2, ...]
    return pairs[:, 0].contiguous(), pairs[:, 1].contiguous()
