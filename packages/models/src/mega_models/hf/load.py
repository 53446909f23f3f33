"""Import: fill this rank's shards of a GPTModel from a Hugging Face safetensors checkpoint."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import product
from pathlib import Path

import torch
from torch import Tensor, nn

from mega_models.config import GPTConfig
from mega_models.gpt import GPTModel
from mega_models.hf.config import HFLayout, gpt_config_from_hf, hf_layout, read_hf_config
from mega_models.hf.deepseek_v3 import DEEPSEEK_V3
from mega_models.hf.mapping import (
    TensorMap,
    deinterleave_rope,
    fuse_qkv,
    hf_shapes,
    interleave_gate_up,
    rope_block,
    stack_grid,
    tensor_map,
)
from mega_models.hf.moe import routing_semantics
from mega_models.hf.reader import SafetensorsReader
from mega_models.hybrid import HybridModel
from mega_moe import TopKRouter, expert_shard
from mega_tp_layers import shard_spec

__all__ = ["load_hf_weights"]

# fields that change the computed function (dropout, init and max_seq_len do not; nor do
# the MoE training settings: balancing losses, expert-bias updates, dispatcher, capacity)
_MUST_MATCH = (
    "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "kv_heads", "ffn_size",
    "norm", "norm_eps", "activation", "position", "rope_theta", "qk_norm", "tie_embeddings",
    "num_experts", "head_dim", "attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "rope_scaling_factor", "rope_original_max_position",
    "rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim",
)  # fmt: skip
_MOE_MUST_MATCH = (
    "moe_layers", "moe_top_k", "moe_ffn_size", "moe_shared_expert_size",
    "moe_shared_expert_gate", "moe_scaling_factor", "moe_num_groups", "moe_group_topk",
)  # fmt: skip


def _group_rule(config: GPTConfig) -> int | None:
    """How many best scores a group's score sums (None: no group-limited routing)."""
    return config.moe_config().router.group_scored_by if config.moe_num_groups else None


def _check_config(model: GPTModel, theirs: GPTConfig, arch: str, hf_dir: Path) -> None:
    mine = model.config
    pairs = [(f, getattr(mine, f), getattr(theirs, f)) for f in _MUST_MATCH]
    if theirs.is_moe and mine.is_moe:
        pairs += [(f, getattr(mine, f), getattr(theirs, f)) for f in _MOE_MUST_MATCH]
        pairs.append(("routing", routing_semantics(mine), routing_semantics(theirs)))
        pairs.append(("moe_group_score_topk", _group_rule(mine), _group_rule(theirs)))
    if arch == DEEPSEEK_V3:  # its e_score_correction_bias is part of the routing
        pairs.append(("moe_expert_bias", mine.moe_expert_bias, True))
    if model.mtp_depth > theirs.mtp_num_layers:  # fewer depths drop the checkpoint's last
        pairs.append(("mtp_num_layers", model.mtp_depth, theirs.mtp_num_layers))
    # the model may have more biases than the checkpoint (they are loaded as zeros)
    if theirs.add_bias and not mine.add_bias:
        pairs.append(("add_bias", mine.add_bias, theirs.add_bias))
    if theirs.qkv_bias and not (mine.qkv_bias or mine.add_bias):
        pairs.append(("qkv_bias", mine.qkv_bias, theirs.qkv_bias))
    for field, a, b in pairs:
        if a != b:
            raise ValueError(
                f"model config {field} ({a!r}) differs from the checkpoint's ({b!r}) in "
                f"{hf_dir}; build the model from gpt_config_from_hf({str(hf_dir)!r})"
            )


def _local_index(param: Tensor) -> tuple[slice, ...]:
    """Where ``param``'s local tensor sits in the full mega tensor (all experts, no etp cut)."""
    shard = expert_shard(param)
    if shard is None:
        spec = shard_spec(param)
        assert spec is not None
        return spec.local_slice
    per = [slice(None)] * len(shard.expert_shape)
    size = shard.expert_shape[shard.etp_dim] // shard.etp
    per[shard.etp_dim] = slice(shard.etp_rank * size, (shard.etp_rank + 1) * size)
    if shard.stacked:  # [E/ep, ...]: this ep rank's experts
        return (slice(shard.first_expert, shard.first_expert + shard.num_local), *per)
    return tuple(per)


def _rows(index: tuple[slice, ...], local_rows: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of the full tensor a local tensor of ``local_rows`` rows holds."""
    start = index[0].start or 0
    return start, start + local_rows


class _ShardBuilder:
    """Builds one rank's local tensor for a :class:`TensorMap` from the checkpoint."""

    def __init__(self, reader: SafetensorsReader, config: GPTConfig) -> None:
        self.reader, self.config = reader, config

    def check_shapes(self, tmap: TensorMap, only: Sequence[str] | None = None) -> None:
        """Every HF tensor of ``tmap`` (or those in ``only``) has the shape the config says."""
        for name, want in zip(tmap.hf, hf_shapes(tmap, self.config), strict=True):
            if only is not None and name not in only:
                continue
            got = self.reader.shape(name)
            if got != want:
                raise ValueError(
                    f"tensor {name} has shape {got} in the checkpoint but {tmap.mega} needs "
                    f"{want}; the checkpoint does not match its config.json"
                )

    def build(
        self, tmap: TensorMap, index: tuple[slice, ...], shape: tuple[int, ...], dtype: torch.dtype
    ) -> Tensor:
        """The local tensor of ``shape`` at ``index`` of the full mega tensor ``tmap`` makes."""
        if tmap.kind == "absent":
            return torch.zeros(shape, dtype=dtype)
        if tmap.kind == "stack":
            return self._stacked(tmap, index, dtype)
        self.check_shapes(tmap)
        if tmap.kind == "copy":
            return self.reader.read(tmap.hf[0], index, dtype)
        if tmap.kind in ("q_rope", "kv_rope"):  # whole blocks: tp splits q by heads
            local = self.reader.read(tmap.hf[0], index, dtype)
            return deinterleave_rope(local, *rope_block(tmap.kind, self.config))
        start, stop = _rows(index, shape[0])
        if tmap.kind == "vocab":
            return self._vocab_rows(tmap.hf[0], start, stop, shape, dtype)
        if tmap.kind == "gate_up":
            assert start % 2 == 0 and stop % 2 == 0, "a shard splits a gate/up pair"
            gate, up = (self.reader.read_rows(n, start // 2, stop // 2, dtype) for n in tmap.hf)
            return interleave_gate_up(gate, up)
        return self._qkv_rows(tmap, start, stop, dtype)

    def _stacked(self, tmap: TensorMap, index: tuple[slice, ...], dtype: torch.dtype) -> Tensor:
        """Only the HF tensors of the picked grid cells (e.g. this rank's experts) are read."""
        grid, lead = tmap.grid, len(tmap.grid)
        picked = [range(n)[s] for n, s in zip(grid, index[:lead], strict=True)]
        strides = [1] * lead
        for d in range(lead - 2, -1, -1):
            strides[d] = strides[d + 1] * grid[d + 1]
        names = [
            tmap.hf[sum(i * s for i, s in zip(cell, strides, strict=True))]
            for cell in product(*picked)
        ]
        self.check_shapes(tmap, only=names)
        pieces = [self.reader.read(name, index[lead:], dtype) for name in names]
        return stack_grid(pieces, tuple(len(r) for r in picked))

    def _vocab_rows(
        self, name: str, start: int, stop: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> Tensor:
        out = torch.zeros(shape, dtype=dtype)  # padding rows stay zero
        real = min(stop, self.config.vocab_size)
        if real > start:
            out[: real - start] = self.reader.read_rows(name, start, real, dtype)
        return out

    def _qkv_rows(self, tmap: TensorMap, start: int, stop: int, dtype: torch.dtype) -> Tensor:
        c = self.config
        d, per_group = c.head_dim, c.num_attention_heads // c.kv_heads
        group_rows = (per_group + 2) * d
        assert start % group_rows == 0 and stop % group_rows == 0, "a shard splits a KV group"
        g0, g1 = start // group_rows, stop // group_rows  # this shard's KV groups
        q = self.reader.read_rows(tmap.hf[0], g0 * per_group * d, g1 * per_group * d, dtype)
        k = self.reader.read_rows(tmap.hf[1], g0 * d, g1 * d, dtype)
        v = self.reader.read_rows(tmap.hf[2], g0 * d, g1 * d, dtype)
        return fuse_qkv(q, k, v, g1 - g0)  # -> [(g1-g0)(n/kv + 2) d, ...]


def _load_expert_biases(model: nn.Module, builder: _ShardBuilder, layout: HFLayout) -> None:
    """The routers' aux-loss-free biases: DeepSeek-V3's ``e_score_correction_bias``, else zero
    (the checkpoint routes without one)."""
    for name, module in model.named_modules():
        if isinstance(module, TopKRouter) and module.expert_bias is not None:
            bias = module.expert_bias
            tmap = tensor_map(f"{name}.expert_bias", layout)
            index = (slice(None),)
            bias.copy_(builder.build(tmap, index, tuple(bias.shape), bias.dtype))


def load_hf_weights(model: GPTModel | HybridModel, hf_dir: str | Path) -> None:
    """Copy a Hugging Face checkpoint into ``model``'s parameters (this rank's shards only).

    ``model`` may be any tp shard, any expert-parallel (ep, etp) shard and any pipeline
    stage (or virtual chunk) of a GPTModel whose config equals ``gpt_config_from_hf(hf_dir)``
    in every field that changes the computed function (it may have biases the checkpoint
    lacks: they are loaded as zeros; fewer MTP depths than the checkpoint, or none with
    ``GPTModel(mtp=False)``). Only the safetensors files that hold this stage's
    tensors are opened, and only this rank's experts and rows (columns for row-parallel
    weights) are read. The routers' aux-loss-free biases, if any, are DeepSeek-V3's
    ``e_score_correction_bias``, or zero for the other architectures. No
    communication. Fails in one sentence naming the tensor on a missing shard file, a
    missing tensor (an expert's included) or a shape mismatch. A HybridModel loads a
    ``NemotronHForCausalLM`` (:func:`~mega_models.hf.load_nemotron_h_weights`).
    """
    if isinstance(model, HybridModel):
        from mega_models.hf.nemotron_h import load_nemotron_h_weights

        return load_nemotron_h_weights(model, hf_dir)
    path = Path(hf_dir)
    cfg = read_hf_config(path)
    layout: HFLayout = hf_layout(cfg)
    _check_config(model, gpt_config_from_hf(cfg), layout.architecture, path)
    with SafetensorsReader(path) as reader:
        builder = _ShardBuilder(reader, model.config)
        for name, param in model.named_parameters():
            if shard_spec(param) is None:
                raise ValueError(f"parameter {name} has no shard spec; build it with GPTModel")
            shape = tuple(param.shape)
            local = builder.build(tensor_map(name, layout), _local_index(param), shape, param.dtype)
            assert tuple(local.shape) == shape, (name, local.shape, shape)
            with torch.no_grad():
                param.copy_(local)
        with torch.no_grad():
            _load_expert_biases(model, builder, layout)
