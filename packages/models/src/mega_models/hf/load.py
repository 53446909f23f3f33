"""Import: fill this rank's shards of a GPTModel from a Hugging Face safetensors checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from mega_models.config import GPTConfig
from mega_models.gpt import GPTModel
from mega_models.hf.config import HFLayout, gpt_config_from_hf, hf_layout, read_hf_config
from mega_models.hf.mapping import (
    TensorMap,
    fuse_qkv,
    hf_shapes,
    interleave_gate_up,
    tensor_map,
)
from mega_models.hf.reader import SafetensorsReader
from mega_tp_layers import ShardSpec, shard_spec

__all__ = ["load_hf_weights"]

# fields that change the computed function (dropout, init and max_seq_len do not)
_MUST_MATCH = (
    "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "kv_heads", "ffn_size",
    "norm", "norm_eps", "activation", "position", "rope_theta", "qk_norm", "tie_embeddings",
    "add_bias",
)  # fmt: skip


def _check_config(mine: GPTConfig, theirs: GPTConfig, hf_dir: Path) -> None:
    for field in _MUST_MATCH:
        a, b = getattr(mine, field), getattr(theirs, field)
        if a != b:
            raise ValueError(
                f"model config {field} ({a!r}) differs from the checkpoint's ({b!r}) in "
                f"{hf_dir}; build the model from gpt_config_from_hf({str(hf_dir)!r})"
            )


def _row_range(spec: ShardSpec) -> tuple[int, int]:
    """Rows ``[start, stop)`` of the full tensor this shard holds (the whole dim if unsplit)."""
    rows = spec.full_shape[0]
    if spec.dim != 0:
        return 0, rows
    size = rows // spec.num_shards
    return spec.shard_rank * size, (spec.shard_rank + 1) * size


class _ShardBuilder:
    """Builds one rank's local tensor for a :class:`TensorMap` from the checkpoint."""

    def __init__(self, reader: SafetensorsReader, config: GPTConfig) -> None:
        self.reader, self.config = reader, config

    def check_shapes(self, tmap: TensorMap) -> None:
        for name, want in zip(tmap.hf, hf_shapes(tmap, self.config), strict=True):
            got = self.reader.shape(name)
            if got != want:
                raise ValueError(
                    f"tensor {name} has shape {got} in the checkpoint but {tmap.mega} needs "
                    f"{want}; the checkpoint does not match its config.json"
                )

    def build(self, tmap: TensorMap, spec: ShardSpec, dtype: torch.dtype) -> Tensor:
        if tmap.kind == "absent":
            return torch.zeros(spec.local_shape, dtype=dtype)
        self.check_shapes(tmap)
        if tmap.kind == "copy":
            return self.reader.read(tmap.hf[0], spec.local_slice, dtype)
        start, stop = _row_range(spec)
        if tmap.kind == "vocab":
            return self._vocab_rows(tmap.hf[0], start, stop, spec, dtype)
        if tmap.kind == "gate_up":
            assert start % 2 == 0 and stop % 2 == 0, "a shard splits a gate/up pair"
            gate, up = (self.reader.read_rows(n, start // 2, stop // 2, dtype) for n in tmap.hf)
            return interleave_gate_up(gate, up)
        return self._qkv_rows(tmap, start, stop, dtype)

    def _vocab_rows(
        self, name: str, start: int, stop: int, spec: ShardSpec, dtype: torch.dtype
    ) -> Tensor:
        out = torch.zeros(spec.local_shape, dtype=dtype)  # padding rows stay zero
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


def load_hf_weights(model: GPTModel, hf_dir: str | Path) -> None:
    """Copy a Hugging Face checkpoint into ``model``'s parameters (this rank's shards only).

    ``model`` may be any tp shard and any pipeline stage (or virtual chunk) of a GPTModel
    whose config equals ``gpt_config_from_hf(hf_dir)`` in every field that changes the
    computed function. Only the safetensors files that hold this stage's tensors are
    opened, and only this shard's rows (columns for row-parallel weights) are read.
    No communication. Fails in one sentence naming the tensor on a missing shard file,
    a missing tensor or a shape mismatch.
    """
    path = Path(hf_dir)
    cfg = read_hf_config(path)
    layout: HFLayout = hf_layout(cfg)
    _check_config(model.config, gpt_config_from_hf(cfg), path)
    with SafetensorsReader(path) as reader:
        builder = _ShardBuilder(reader, model.config)
        for name, param in model.named_parameters():
            spec = shard_spec(param)
            if spec is None:
                raise ValueError(f"parameter {name} has no shard spec; build it with GPTModel")
            local = builder.build(tensor_map(name, layout), spec, param.dtype)
            assert tuple(local.shape) == tuple(param.shape), (name, local.shape, param.shape)
            with torch.no_grad():
                param.copy_(local)
