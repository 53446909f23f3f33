"""Names and layouts: which Hugging Face tensors make each GPTModel parameter, and how.

Pure tensor arithmetic, no files. Four layouts differ between the two sides:

* ``qkv`` — HF keeps ``q_proj``, ``k_proj``, ``v_proj``; mega fuses them grouped by KV
  head (for each group: its query heads, its key head, its value head).
* ``gate_up`` — HF keeps ``gate_proj`` and ``up_proj``; mega's SwiGLU ``fc1`` interleaves
  their rows one by one (gate_0, up_0, gate_1, up_1, ...).
* ``vocab`` — mega pads the vocabulary rows to a multiple of tp with zeros.
* ``stack`` — HF keeps one tensor per expert and per projection (Mixtral
  ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down), Qwen2-MoE and
  Qwen3-MoE ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``); mega stacks them in
  leading dimensions: GroupedMLP ``weight1 [E, 2, f, h]`` (gate, then up) and ``weight2
  [E, h, f]``, a SequentialMLP expert's or the shared expert's ``weight1 [2, f, h]``.
  ``TensorMap.grid`` gives the leading dimensions; the HF names fill it row-major.

Qwen3's (and Qwen3-MoE's) ``self_attn.q_norm`` / ``k_norm`` (one scale per head dim, shared by all heads)
are mega's ``attention.q_norm`` / ``k_norm``, replicated over tp: copied whole.

RoPE needs no permutation for the Llama family: HF-format Llama weights already use the
rotate-half convention that :func:`mega_models.rope.apply_rope` uses. DeepSeek-V3's
(``rope_interleave``) rope rows are interleaved pairs: the ``q_rope`` / ``kv_rope`` kinds
put the rope rows of each head of ``q_b_proj`` and of ``kv_a_proj_with_mqa`` evens first,
then odds, on import (:func:`deinterleave_rope`), and back on export
(:func:`interleave_rope`); the scores are unchanged, q and k being permuted alike.

DeepSeek-V3 (:mod:`mega_models.hf.deepseek_v3`): MLA's ``attention.q_down`` /
``q_norm`` / ``q_up`` / ``kv_down`` / ``kv_norm`` / ``kv_up`` are ``self_attn.q_a_proj`` /
``q_a_layernorm`` / ``q_b_proj`` (``q_proj`` without q_lora_rank) /
``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``; the router's expert bias (a
buffer) is ``mlp.gate.e_score_correction_bias``; the shared expert is
``mlp.shared_experts``. MTP depth ``k`` (``mtp.{k}``) is ``model.layers.{L + k}``:
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` (mega's ``final_norm``) and a
decoder layer's tensors; its ``embed_tokens`` and ``shared_head.head`` are copies of the
model's embedding and output layer (:func:`mtp_copies`), written on export and not read.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from mega_models.config import GPTConfig
from mega_models.hf.config import HFLayout
from mega_models.hf.deepseek_v3 import DEEPSEEK_V3
from mega_models.hf.moe import MIXTRAL, QWEN2_MOE, QWEN3_MOE

__all__ = [
    "TensorMap",
    "deinterleave_rope",
    "fuse_qkv",
    "gpt_parameter_names",
    "hf_shapes",
    "hf_tensor_names",
    "interleave_gate_up",
    "interleave_rope",
    "mtp_copies",
    "rope_block",
    "split_gate_up",
    "split_qkv",
    "stack_grid",
    "tensor_map",
    "unstack_grid",
]

Kind = Literal["copy", "vocab", "qkv", "gate_up", "stack", "q_rope", "kv_rope", "absent"]

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
_MTP_OWN: dict[str, str] = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_norm.weight": "shared_head.norm.weight",
}
_MLA: dict[str, str] = {
    "attention.q_down.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.kv_up.weight": "self_attn.kv_b_proj.weight",
}
_EXPERT_BIAS = "mlp.router.expert_bias"
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(weight[12])")
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
    "attention.q_norm.weight": ("copy", ("self_attn.q_norm.weight",)),
    "attention.k_norm.weight": ("copy", ("self_attn.k_norm.weight",)),
    "attention.proj.weight": ("copy", ("self_attn.o_proj.weight",)),
    "attention.proj.bias": ("copy", ("self_attn.o_proj.bias",)),
    "mlp.fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.fc1.bias": ("gate_up", ("mlp.gate_proj.bias", "mlp.up_proj.bias")),
    "mlp.fc2.weight": ("copy", ("mlp.down_proj.weight",)),
    "mlp.fc2.bias": ("copy", ("mlp.down_proj.bias",)),
}
_QK_NORMS = ("attention.q_norm.weight", "attention.k_norm.weight")
_TOP: dict[str, tuple[Kind, tuple[str, ...]]] = {
    "embedding.word.weight": ("vocab", ("model.embed_tokens.weight",)),
    "output.weight": ("vocab", ("lm_head.weight",)),
    "final_norm.weight": ("copy", ("model.norm.weight",)),
}


@dataclass(frozen=True)
class _ExpertNames:
    """Where an MoE architecture keeps its sparse block's tensors, inside ``model.layers.i.``."""

    block: str
    gate: str
    up: str
    down: str
    shared: str = ""
    """The shared expert's module inside ``model.layers.i.`` ("": none)."""


_EXPERT_NAMES = {
    MIXTRAL: _ExpertNames("block_sparse_moe", "w1", "w3", "w2"),
    QWEN2_MOE: _ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", "mlp.shared_expert"),
    QWEN3_MOE: _ExpertNames("mlp", "gate_proj", "up_proj", "down_proj"),
    DEEPSEEK_V3: _ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", "mlp.shared_experts"),
}


@dataclass(frozen=True)
class TensorMap:
    """How one GPTModel parameter is made of Hugging Face tensors."""

    mega: str
    """The parameter's name in ``GPTModel.named_parameters()``."""
    kind: Kind
    """``copy``, ``vocab`` (padded rows), ``qkv``, ``gate_up``, ``stack``, or ``absent``
    (zero in mega)."""
    hf: tuple[str, ...]
    """The Hugging Face tensor names, in the order the kind fuses them (empty if absent;
    ``q_rope`` / ``kv_rope``: one tensor whose rope rows are permuted)."""
    grid: tuple[int, ...] = ()
    """For ``stack``: the leading dimensions of the mega tensor the HF tensors fill
    (row-major), e.g. ``(E, 2)`` for GroupedMLP's ``weight1``."""


def _has_bias(suffix: str, layout: HFLayout) -> bool:
    if suffix == "attention.qkv.bias":
        return layout.qkv_bias
    if suffix == "attention.proj.bias":
        return layout.proj_bias
    return layout.mlp_bias


def _no_counterpart(mega_name: str, layout: HFLayout) -> ValueError:
    return ValueError(
        f"parameter {mega_name} has no Hugging Face counterpart in {layout.architecture}; "
        "only GPTModels with rmsnorm, swiglu and rope convert, qk_norm as Qwen3ForCausalLM or "
        "Qwen3MoeForCausalLM, MoE layers as MixtralForCausalLM, Qwen2MoeForCausalLM (shared "
        "experts) or Qwen3MoeForCausalLM, latent attention and MTP as DeepseekV3ForCausalLM"
    )


def _expert_map(mega_name: str, suffix: str, prefix: str, layout: HFLayout) -> TensorMap:
    """The :class:`TensorMap` of a router, expert or shared-expert parameter."""
    names = _EXPERT_NAMES.get(layout.architecture)
    experts = layout.num_experts
    if names is None or experts < 1:
        raise _no_counterpart(mega_name, layout)
    block = f"{prefix}{names.block}."

    def expert(e: int, which: str) -> str:
        return f"{block}experts.{e}.{which}.weight"

    if suffix == "mlp.router.weight":
        return TensorMap(mega_name, "copy", (f"{block}gate.weight",))
    if suffix == _EXPERT_BIAS:  # a buffer; zero in mega where the architecture has none
        if layout.architecture != DEEPSEEK_V3:
            return TensorMap(mega_name, "absent", ())
        return TensorMap(mega_name, "copy", (f"{block}gate.e_score_correction_bias",))
    if suffix == "mlp.experts.weight1":
        hf = tuple(expert(e, w) for e in range(experts) for w in (names.gate, names.up))
        return TensorMap(mega_name, "stack", hf, (experts, 2))
    if suffix == "mlp.experts.weight2":
        hf = tuple(expert(e, names.down) for e in range(experts))
        return TensorMap(mega_name, "stack", hf, (experts,))
    local = _LOCAL_EXPERT.fullmatch(suffix)
    if local is not None and int(local.group(1)) < experts:
        e = int(local.group(1))
        if local.group(2) == "weight1":
            return TensorMap(mega_name, "stack", (expert(e, names.gate), expert(e, names.up)), (2,))
        return TensorMap(mega_name, "copy", (expert(e, names.down),))
    shared = f"{prefix}{names.shared}."
    if names.shared and suffix == "mlp.shared_experts.weight1":
        hf = (f"{shared}gate_proj.weight", f"{shared}up_proj.weight")
        return TensorMap(mega_name, "stack", hf, (2,))
    if names.shared and suffix == "mlp.shared_experts.weight2":
        return TensorMap(mega_name, "copy", (f"{shared}down_proj.weight",))
    if (
        names.shared
        and suffix == "mlp.shared_experts.gate_weight"
        and layout.architecture == QWEN2_MOE
    ):
        return TensorMap(mega_name, "copy", (f"{prefix}mlp.shared_expert_gate.weight",))
    raise _no_counterpart(mega_name, layout)


def _mla_map(mega_name: str, suffix: str, prefix: str, layout: HFLayout) -> TensorMap | None:
    """The :class:`TensorMap` of a latent-attention weight (None for the other names)."""
    if suffix in _MLA:
        return TensorMap(mega_name, "copy", (prefix + _MLA[suffix],))
    rope: Kind = "copy"
    if suffix == "attention.q_up.weight":
        name = "self_attn.q_b_proj.weight" if layout.q_lora else "self_attn.q_proj.weight"
        rope = "q_rope"
    elif suffix == "attention.kv_down.weight":
        name, rope = "self_attn.kv_a_proj_with_mqa.weight", "kv_rope"
    else:
        return None
    return TensorMap(mega_name, rope if layout.rope_interleave else "copy", (prefix + name,))


def tensor_map(mega_name: str, layout: HFLayout) -> TensorMap:
    """The :class:`TensorMap` of one GPTModel parameter name (global layer index; MTP depth
    ``k``'s as ``mtp.{k}.*``)."""
    if mega_name in _TOP:
        kind, hf = _TOP[mega_name]
        return TensorMap(mega_name, kind, hf)
    mtp = _MTP.fullmatch(mega_name)
    if mtp is not None and layout.architecture == DEEPSEEK_V3:
        depth, rest = mtp.groups()
        prefix = _HF_LAYER.format(i=layout.num_layers + int(depth))
        if rest in _MTP_OWN:
            return TensorMap(mega_name, "copy", (prefix + _MTP_OWN[rest],))
        if rest.startswith("layer."):
            return _layer_map(mega_name, rest.removeprefix("layer."), prefix, layout)
    match = _LAYER.fullmatch(mega_name)
    if match is None:
        raise _no_counterpart(mega_name, layout)
    layer, suffix = match.groups()
    return _layer_map(mega_name, suffix, _HF_LAYER.format(i=layer), layout)


def _layer_map(mega_name: str, suffix: str, prefix: str, layout: HFLayout) -> TensorMap:
    """The :class:`TensorMap` of a decoder layer's parameter ``suffix``."""
    if layout.mla:
        mla = _mla_map(mega_name, suffix, prefix, layout)
        if mla is not None:
            return mla
    if suffix not in _PER_LAYER:
        return _expert_map(mega_name, suffix, prefix, layout)
    kind, hf = _PER_LAYER[suffix]
    if suffix in _QK_NORMS and not layout.qk_norm:
        raise _no_counterpart(mega_name, layout)
    if suffix.endswith(".bias") and not _has_bias(suffix, layout):
        return TensorMap(mega_name, "absent", ())
    return TensorMap(mega_name, kind, tuple(prefix + name for name in hf))


def _expert_shape(suffix: str, c: GPTConfig) -> tuple[int, ...] | None:
    """The full mega shape of a router / expert / shared-expert parameter (SwiGLU: 2 rows)."""
    h, e, f, fs = c.hidden_size, c.num_experts, c.moe_ffn_size, c.moe_shared_expert_size
    shapes: dict[str, tuple[int, ...]] = {
        "mlp.router.weight": (e, h),
        _EXPERT_BIAS: (e,),
        "mlp.experts.weight1": (e, 2, f, h),
        "mlp.experts.weight2": (e, h, f),
        "mlp.shared_experts.weight1": (2, fs, h),
        "mlp.shared_experts.weight2": (h, fs),
        "mlp.shared_experts.gate_weight": (1, h),
    }
    local = _LOCAL_EXPERT.fullmatch(suffix)
    if local is not None:
        return (2, f, h) if local.group(2) == "weight1" else (h, f)
    return shapes.get(suffix)


def _mla_shape(suffix: str, c: GPTConfig) -> tuple[int, ...] | None:
    """The full shape of a latent-attention weight (None for the other names)."""
    if c.attention != "mla":
        return None
    assert c.kv_lora_rank and c.qk_nope_head_dim and c.qk_rope_head_dim and c.v_head_dim
    h, n, rope, kv = c.hidden_size, c.num_attention_heads, c.qk_rope_head_dim, c.kv_lora_rank
    q_in = c.q_lora_rank or h
    shapes: dict[str, tuple[int, ...]] = {
        "attention.q_down.weight": (q_in, h),
        "attention.q_norm.weight": (q_in,),
        "attention.q_up.weight": (n * (c.qk_nope_head_dim + rope), q_in),
        "attention.kv_down.weight": (kv + rope, h),
        "attention.kv_norm.weight": (kv,),
        "attention.kv_up.weight": (n * (c.qk_nope_head_dim + c.v_head_dim), kv),
        "attention.proj.weight": (h, n * c.v_head_dim),
    }
    return shapes.get(suffix)


def _suffix(mega_name: str) -> str:
    """A layer parameter's name inside its layer (an MTP depth's layer too), else the name."""
    if mega_name.startswith("layers."):
        return mega_name.split(".", 2)[-1]
    mtp = _MTP.fullmatch(mega_name)
    if mtp is not None:
        rest = mtp.group(2)
        return rest.removeprefix("layer.") if rest.startswith("layer.") else f"mtp.{rest}"
    return mega_name


def hf_shapes(tmap: TensorMap, config: GPTConfig) -> tuple[tuple[int, ...], ...]:
    """The full shapes the Hugging Face tensors of ``tmap`` must have under ``config``."""
    c = config
    h, d, f = c.hidden_size, c.head_dim, c.ffn_size
    q, kv = c.num_attention_heads * d, c.kv_heads * d
    bias = tmap.mega.endswith(".bias")

    def shape(rows: int, cols: int) -> tuple[int, ...]:
        return (rows,) if bias else (rows, cols)

    suffix = _suffix(tmap.mega)
    expert = _expert_shape(suffix, c)
    if expert is not None:
        return (expert[len(tmap.grid) :],) * len(tmap.hf)
    mla = _mla_shape(suffix, c)
    if mla is not None:
        return (mla,)
    if suffix == "mtp.eh_proj.weight":
        return ((h, 2 * h),)
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
    if suffix in _QK_NORMS:
        return ((d,),)
    return ((h,),)  # norms and the row-parallel biases


def _attention_names(config: GPTConfig, every: bool) -> list[str]:
    c = config
    if c.attention == "mla":
        q = ["q_down", "q_norm", "q_up"] if c.q_lora_rank is not None else ["q_up"]
        names = [*q, "kv_down", "kv_norm", "kv_up", "proj"]
        return [f"attention.{n}.weight" for n in names]
    names = ["attention.qkv.weight"]
    names += ["attention.qkv.bias"] if every or c.qkv_bias else []
    names += list(_QK_NORMS) if c.qk_norm else []
    return names + ["attention.proj.weight"] + (["attention.proj.bias"] if every else [])


def _layer_names(config: GPTConfig, i: int, all_biases: bool) -> list[str]:
    c, every = config, all_biases or config.add_bias
    names = ["input_norm.weight", *_attention_names(config, every), "mlp_norm.weight"]
    if not c.is_moe_layer(i):
        names += ["mlp.fc1.weight", "mlp.fc2.weight"]
        return names + (["mlp.fc1.bias", "mlp.fc2.bias"] if every else [])
    names.append("mlp.router.weight")
    names += [_EXPERT_BIAS] if all_biases or c.moe_expert_bias else []
    if c.moe_grouped_experts:
        names += ["mlp.experts.weight1", "mlp.experts.weight2"]
    else:
        names += [f"mlp.experts.local_experts.{e}.weight{w}" for e in range(c.num_experts)
                  for w in (1, 2)]  # fmt: skip
    if c.moe_shared_expert_size:
        names += ["mlp.shared_experts.weight1", "mlp.shared_experts.weight2"]
        names += ["mlp.shared_experts.gate_weight"] if c.moe_shared_expert_gate else []
    return names


def gpt_parameter_names(config: GPTConfig, *, all_biases: bool = False) -> list[str]:
    """The full-model parameter names of a GPTModel of ``config`` (every expert once), with
    the routers' expert biases (buffers) when ``moe_expert_bias`` is on and the MTP depths'
    names (``mtp.{k}.*``, their layer of the last decoder layer's kind).

    ``all_biases`` adds every bias a layer could have (those the model lacks included).
    """
    names = ["embedding.word.weight"]
    for i in range(config.num_layers):
        names += [f"layers.{i}.{s}" for s in _layer_names(config, i, all_biases)]
    last = config.num_layers - 1
    for k in range(config.mtp_num_layers):
        names += [f"mtp.{k}.{s}" for s in ("enorm.weight", "hnorm.weight", "eh_proj.weight")]
        names += [f"mtp.{k}.layer.{s}" for s in _layer_names(config, last, all_biases)]
        names.append(f"mtp.{k}.final_norm.weight")
    names.append("final_norm.weight")
    if not config.tie_embeddings:
        names.append("output.weight")
    return names


def mtp_copies(config: GPTConfig, layout: HFLayout) -> dict[str, str]:
    """DeepSeek-V3's per-depth copies of the embedding and output layer: HF name -> mega name."""
    if layout.architecture != DEEPSEEK_V3:
        return {}
    head = "embedding.word.weight" if config.tie_embeddings else "output.weight"
    out: dict[str, str] = {}
    for k in range(config.mtp_num_layers):
        prefix = _HF_LAYER.format(i=config.num_layers + k)
        out[f"{prefix}embed_tokens.weight"] = "embedding.word.weight"
        out[f"{prefix}shared_head.head.weight"] = head
    return out


def hf_tensor_names(config: GPTConfig, layout: HFLayout) -> list[str]:
    """Every tensor a Hugging Face checkpoint of ``config`` holds, in file order."""
    names = ["model.embed_tokens.weight"]
    for name in gpt_parameter_names(config, all_biases=True):
        if name not in _TOP:
            tmap = tensor_map(name, layout)
            names.extend(tmap.hf)
    names += list(mtp_copies(config, layout))
    names.append("model.norm.weight")
    if not config.tie_embeddings:
        names.append("lm_head.weight")
    return names


def _rope_order(block: int, offset: int, width: int) -> Tensor:
    """Row order of one ``block``: its rope rows ``[offset, offset + width)`` evens, then odds."""
    rope = torch.arange(offset, offset + width)
    return torch.cat(
        [torch.arange(offset), rope[0::2], rope[1::2], torch.arange(offset + width, block)]
    )


def deinterleave_rope(rows: Tensor, block: int, offset: int, width: int) -> Tensor:
    """Rows made of whole ``block``-row blocks, rope rows as interleaved pairs -> rotate-half
    order (each block's rope rows evens first, then odds)."""
    order = _rope_order(block, offset, width)
    blocks = rows.reshape(-1, block, *rows.shape[1:])  # [rows, ...] -> [n, block, ...]
    return blocks[:, order].reshape(rows.shape).contiguous()


def interleave_rope(rows: Tensor, block: int, offset: int, width: int) -> Tensor:
    """The inverse of :func:`deinterleave_rope`."""
    order = torch.argsort(_rope_order(block, offset, width))
    blocks = rows.reshape(-1, block, *rows.shape[1:])
    return blocks[:, order].reshape(rows.shape).contiguous()


def rope_block(kind: Kind, config: GPTConfig) -> tuple[int, int, int]:
    """``(block, offset, width)`` of a ``q_rope`` (per head) or ``kv_rope`` (the latent) tensor."""
    c = config
    assert c.qk_nope_head_dim and c.qk_rope_head_dim and c.kv_lora_rank
    if kind == "q_rope":
        return c.qk_nope_head_dim + c.qk_rope_head_dim, c.qk_nope_head_dim, c.qk_rope_head_dim
    return c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank, c.qk_rope_head_dim


def stack_grid(tensors: Sequence[Tensor], grid: tuple[int, ...]) -> Tensor:
    """Equal-shaped tensors, row-major over ``grid`` -> one ``[*grid, *shape]`` tensor."""
    return torch.stack(list(tensors)).reshape(*grid, *tensors[0].shape)


def unstack_grid(full: Tensor, grid: tuple[int, ...]) -> list[Tensor]:
    """The inverse of :func:`stack_grid`: contiguous tensors in row-major order."""
    flat = full.reshape(-1, *full.shape[len(grid) :])  # [*grid, ...] -> [prod(grid), ...]
    return [t.contiguous() for t in flat.unbind(0)]


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
