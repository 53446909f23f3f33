"""The Nemotron-H bridge: ``NemotronHForCausalLM`` safetensors <-> :class:`HybridModel`.

Import fills one rank's shards (any tp, any pipeline stage) reading only its rows (columns
for row-parallel weights) from the files; export takes the full tensors
(:func:`~mega_models.hf.gather_full_state`) and writes config.json and safetensors shards
with an index, the tensors exactly as transformers saves them. The config mapping is in
:mod:`mega_models.hf.nemotron_h_config`, the tensor layouts in
:mod:`mega_models.hf.hybrid_mapping`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mega_models.hf.config import HFSource, read_hf_config
from mega_models.hf.hybrid_mapping import (
    BACKBONE,
    HybridTensorMap,
    conv_rows,
    hybrid_parameter_names,
    hybrid_tensor_map,
    in_proj_rows,
    nemotron_h_tensor_names,
)
from mega_models.hf.load import _ShardBuilder
from mega_models.hf.mapping import TensorMap, split_qkv
from mega_models.hf.nemotron_h_config import (
    check_nemotron_h_convertible,
    hf_config_from_nemotron_h,
    nemotron_h_config_from_hf,
)
from mega_models.hf.reader import SafetensorsReader
from mega_models.hf.save import (
    DEFAULT_MAX_SHARD_SIZE,
    source_state,
    state_dtype_name,
    write_hf_folder,
)
from mega_models.hybrid import HybridModel
from mega_models.hybrid_config import HybridConfig
from mega_tp_layers import shard_spec

__all__ = [
    "check_nemotron_h_base",
    "load_nemotron_h_weights",
    "nemotron_h_config",
    "nemotron_h_state_dict",
    "save_nemotron_h_checkpoint",
]

# fields that change the computed function (dropout, init, max_seq_len, chunking do not)
_MUST_MATCH = (
    "vocab_size", "hidden_size", "pattern", "num_attention_heads", "kv_heads", "ffn_size",
    "norm", "norm_eps", "activation", "position", "tie_embeddings", "add_bias", "qkv_bias",
    "qk_norm", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_inner",
    "mamba_conv_width", "mamba_conv_bias", "mamba_dt_limit",
)  # fmt: skip


def nemotron_h_config(source: HFSource) -> HybridConfig:
    """The :class:`HybridConfig` of a Nemotron-H model folder, config.json or dict."""
    return nemotron_h_config_from_hf(read_hf_config(source))


def _check_config(mine: HybridConfig, theirs: HybridConfig, hf_dir: Path) -> None:
    for field in _MUST_MATCH:
        a, b = getattr(mine, field), getattr(theirs, field)
        if a != b:
            raise ValueError(
                f"model config {field} ({a!r}) differs from the checkpoint's ({b!r}) in "
                f"{hf_dir}; build the model from nemotron_h_config({str(hf_dir)!r})"
            )


def _prefix(reader: SafetensorsReader) -> str:
    """``backbone.`` (what transformers writes) or ``model.``, as the checkpoint has it."""
    return "model." if "model.embeddings.weight" in reader.weight_map else BACKBONE


class _Reader:
    """One rank's local tensors of a HybridModel from a Nemotron-H checkpoint."""

    def __init__(self, reader: SafetensorsReader, config: HybridConfig) -> None:
        self.reader, self.config = reader, config
        self.gpt = _ShardBuilder(reader, config)  # the vocab and qkv layouts are GPT's
        self.perms = {"in_proj": in_proj_rows(config), "conv": conv_rows(config)}

    def _check(self, tmap: HybridTensorMap) -> None:
        for name, want in zip(tmap.hf, tmap.shapes, strict=True):
            got = self.reader.shape(name)
            if got != want:
                raise ValueError(
                    f"tensor {name} has shape {got} in the checkpoint but {tmap.mega} needs "
                    f"{want}; the checkpoint does not match its config.json"
                )

    def local(self, tmap: HybridTensorMap, index: tuple[slice, ...], shape: tuple[int, ...],
              dtype: torch.dtype) -> Tensor:  # fmt: skip
        """The local tensor of ``shape`` at ``index`` of the full mega tensor."""
        self._check(tmap)
        if tmap.kind in ("vocab", "qkv"):
            return self.gpt.build(TensorMap(tmap.mega, tmap.kind, tmap.hf), index, shape, dtype)
        name = tmap.hf[0]
        if tmap.kind == "copy":
            return self.reader.read(name, index, dtype)
        perm = self.perms["in_proj" if "in_proj" in name else "conv"]
        start = index[0].start or 0
        return self._rows(name, perm[start : start + shape[0]], dtype).reshape(shape)

    def _rows(self, name: str, rows: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows ``rows`` of tensor ``name``, each contiguous run read as one slice."""
        breaks = (torch.nonzero(rows.diff() != 1).flatten() + 1).tolist()
        bounds = [0, *breaks, len(rows)]
        pieces = [
            self.reader.read_rows(name, int(rows[a]), int(rows[b - 1]) + 1, dtype)
            for a, b in pairwise(bounds)
        ]
        return torch.cat(pieces)


def load_nemotron_h_weights(model: HybridModel, hf_dir: str | Path) -> None:
    """Copy a ``NemotronHForCausalLM`` checkpoint into ``model`` (this rank's shards only).

    ``model`` may be any tp shard and any pipeline stage (or virtual chunk) of a
    HybridModel whose config equals ``nemotron_h_config(hf_dir)`` in every field that
    changes the computed function. Only the files holding this stage's tensors are opened,
    and only this rank's rows (or columns) are read. No communication. Fails in one
    sentence naming the tensor on a missing file or tensor or a shape mismatch.
    """
    path = Path(hf_dir)
    _check_config(model.config, nemotron_h_config(path), path)
    with SafetensorsReader(path) as reader:
        builder, prefix = _Reader(reader, model.config), _prefix(reader)
        for name, param in model.named_parameters():
            spec = shard_spec(param)
            if spec is None:
                raise ValueError(f"parameter {name} has no shard spec; build it with HybridModel")
            tmap = hybrid_tensor_map(name, model.config, prefix)
            shape = tuple(param.shape)
            local = builder.local(tmap, spec.local_slice, shape, param.dtype)
            assert tuple(local.shape) == shape, (name, local.shape, shape)
            with torch.no_grad():
                param.copy_(local)


def _split(tmap: HybridTensorMap, full: Tensor, config: HybridConfig) -> dict[str, Tensor]:
    parts: Sequence[Tensor]
    if tmap.kind == "qkv":
        parts = split_qkv(full, config.num_attention_heads, config.kv_heads)
    elif tmap.kind == "rows":
        perm = in_proj_rows(config) if "in_proj" in tmap.hf[0] else conv_rows(config)
        hf = torch.empty_like(full)
        hf[perm] = full  # mega row i is HF row perm[i]
        parts = (hf.reshape(tmap.shapes[0]),)
    else:
        parts = (full,)
    out = {}
    for name, part, want in zip(tmap.hf, parts, tmap.shapes, strict=True):
        if tuple(part.shape) != want:
            raise ValueError(
                f"tensor {tmap.mega} gives {name} of shape {tuple(part.shape)} but the config "
                f"needs {want}; pass full tensors of a HybridModel of this config, padding cut"
            )
        out[name] = part.contiguous().clone()
    return out


def nemotron_h_state_dict(state: Mapping[str, Tensor], config: HybridConfig) -> dict[str, Tensor]:
    """Full HybridModel tensors (vocabulary unpadded) -> ``NemotronHForCausalLM`` tensors.

    A tied model's embedding is also written as ``lm_head.weight`` (transformers ties nothing).
    """
    check_nemotron_h_convertible(config)
    expected = hybrid_parameter_names(config)
    unknown = sorted(set(state) - set(expected))
    missing = [n for n in expected if n not in state]
    if unknown or missing:
        what = (f"tensor {unknown[0]} is not a parameter of a HybridModel with this config"
                if unknown else f"tensor {missing[0]} is missing from the state to export")  # fmt: skip
        raise ValueError(
            f"{what}; pass every stage's full tensors of a HybridModel built from this config "
            "(gather_full_state(models, pp_group) merges them)"
        )
    out: dict[str, Tensor] = {}
    for name in expected:
        out.update(_split(hybrid_tensor_map(name, config), state[name].detach(), config))
    if config.tie_embeddings:
        out["lm_head.weight"] = out[f"{BACKBONE}embeddings.weight"].clone()
    return {name: out[name] for name in nemotron_h_tensor_names(config)}


def check_nemotron_h_base(config: HybridConfig, base: HFSource, way_out: str) -> None:
    """Raise, in one sentence ending with ``way_out``, if ``base`` (the config.json an
    export keeps the other keys of) describes a model of other dimensions than ``config``."""
    name = "the base config" if isinstance(base, Mapping) else str(base)
    theirs = nemotron_h_config(base)
    for field in ("vocab_size", "hidden_size", "pattern", "num_attention_heads", "kv_heads",
                  "ffn_size", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups",
                  "mamba_inner"):  # fmt: skip
        want, have = getattr(theirs, field), getattr(config, field)
        if want != have:
            raise ValueError(
                f"{name} describes a model with {field} {want!r} but the model to export has "
                f"{have!r}; {way_out}"
            )


def save_nemotron_h_checkpoint(
    source: HybridModel | Sequence[HybridModel] | Mapping[str, Tensor],
    out_dir: str | Path,
    *,
    config: HybridConfig | None = None,
    base_config: str | Path | Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> list[str]:
    """Write a ``NemotronHForCausalLM`` checkpoint (``config.json`` + safetensors) to ``out_dir``.

    ``source`` is a HybridModel built unsplit (tp 1), a list of such models covering every
    layer (pipeline stages built in this process), or a mapping of full tensors as
    :func:`~mega_models.hf.gather_full_state` returns on the first rank of a parallel run
    (then pass ``config``). ``base_config`` (the original config.json) gives every key the
    export does not own; one of another model's dimensions fails in one sentence. ``dtype``
    casts the tensors. Returns the names of the files written. Local: call it on one rank.
    """
    state, full = source_state(
        source, config, saver="save_nemotron_h_checkpoint", model_type=HybridModel,
        split_dims=("tp",),
    )  # fmt: skip
    base = None
    if base_config is not None:
        check_nemotron_h_base(
            full, base_config, "pass the config.json this model was imported from, or none"
        )
        base = read_hf_config(base_config)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    hf_config = hf_config_from_nemotron_h(full, dtype=state_dtype_name(state), base=base)
    return write_hf_folder(nemotron_h_state_dict(state, full), hf_config, out_dir, max_shard_size)
