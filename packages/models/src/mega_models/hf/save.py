"""Export: full GPTModel tensors -> a Hugging Face directory (config.json + safetensors shards)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch import Tensor, nn

from mega_models.config import GPTConfig
from mega_models.gpt import GPTModel
from mega_models.hf.config import (
    HFLayout,
    check_base_config,
    check_convertible,
    default_architecture,
    hf_config_from_gpt,
    hf_layout,
    read_hf_config,
)
from mega_models.hf.gather import gather_full_state
from mega_models.hf.mapping import (
    gpt_parameter_names,
    hf_shapes,
    hf_tensor_names,
    interleave_rope,
    mtp_copies,
    rope_block,
    split_gate_up,
    split_qkv,
    tensor_map,
    unstack_grid,
)
from mega_models.hf.moe import MOE_ARCHITECTURES
from mega_models.hf.reader import INDEX, SINGLE
from mega_models.hybrid import HybridModel
from mega_models.hybrid_config import HybridConfig

__all__ = [
    "hf_state_dict",
    "save_hf_checkpoint",
    "source_state",
    "state_dtype_name",
    "write_hf_folder",
    "write_safetensors",
]

#: Default largest shard file, in bytes (Hugging Face's "5GB").
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9


def _check_names(state: Mapping[str, Tensor], config: GPTConfig) -> None:
    expected = gpt_parameter_names(config)
    unknown = sorted(set(state) - set(expected))
    if unknown:
        raise ValueError(
            f"tensor {unknown[0]} is not a parameter of a GPTModel with this config; pass the "
            "state of a GPTModel built from the same GPTConfig"
        )
    missing = [name for name in expected if name not in state]
    if missing:
        raise ValueError(
            f"tensor {missing[0]} is missing from the state to export; pass every pipeline "
            "stage's tensors (gather_full_state(models, pp_group) merges them)"
        )


def _biased_architecture(name: str, layout: HFLayout) -> str:
    """Where a bias the architecture of ``layout`` lacks can go."""
    if not name.endswith("attention.qkv.bias"):
        return "LlamaForCausalLM (attention_bias and mlp_bias)"
    if layout.architecture in MOE_ARCHITECTURES:
        return "Qwen2MoeForCausalLM"
    return "Qwen2ForCausalLM, or LlamaForCausalLM with attention_bias"


def _split(name: str, full: Tensor, config: GPTConfig, layout: HFLayout) -> dict[str, Tensor]:
    """The Hugging Face tensors of one full mega tensor."""
    tmap = tensor_map(name, layout)
    if tmap.kind == "absent":
        if bool(full.count_nonzero()):
            raise ValueError(
                f"tensor {name} is not zero but {layout.architecture} has no such bias; "
                f"export as {_biased_architecture(name, layout)}"
            )
        return {}
    if tmap.kind == "qkv":
        parts: Sequence[Tensor] = split_qkv(full, config.num_attention_heads, config.kv_heads)
    elif tmap.kind == "gate_up":
        parts = split_gate_up(full)
    elif tmap.kind in ("q_rope", "kv_rope"):
        parts = (interleave_rope(full, *rope_block(tmap.kind, config)),)
    elif tmap.kind == "stack":
        if tuple(full.shape[: len(tmap.grid)]) != tmap.grid:
            raise ValueError(
                f"tensor {name} has shape {tuple(full.shape)} but the config needs "
                f"{tmap.grid + hf_shapes(tmap, config)[0]}; pass the state of a GPTModel "
                "built from the same GPTConfig"
            )
        parts = unstack_grid(full, tmap.grid)
    else:
        parts = (full,)
    out = {}
    for hf_name, part, want in zip(tmap.hf, parts, hf_shapes(tmap, config), strict=True):
        if tuple(part.shape) != want:
            raise ValueError(
                f"tensor {name} gives {hf_name} of shape {tuple(part.shape)} but the config "
                f"needs {want}; pass full tensors with the vocabulary padding cut"
            )
        out[hf_name] = part.contiguous().clone()
    return out


def hf_state_dict(
    state: Mapping[str, Tensor], config: GPTConfig, layout: HFLayout
) -> dict[str, Tensor]:
    """Full mega tensors (names of ``GPTModel.named_parameters()``) -> Hugging Face tensors.

    ``state`` must hold the whole model, vocabulary unpadded (as
    :func:`~mega_models.hf.gather_full_state` gives it). Biases the architecture has and
    the model lacks are written as zeros; biases the model has and the architecture
    lacks must be zero, or the export fails naming the tensor. MTP depths (``mtp.*``) are
    written as DeepSeek-V3 stores them, or left out when ``config.mtp_num_layers`` is 0.
    """
    check_convertible(config)
    if not config.mtp_num_layers:  # dropped at export
        state = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    _check_names(state, config)
    dtype = state["final_norm.weight"].dtype
    out: dict[str, Tensor] = {}
    for name in gpt_parameter_names(config, all_biases=True):
        if name in state:
            out.update(_split(name, state[name].detach(), config, layout))
            continue
        tmap = tensor_map(name, layout)  # a bias the model lacks: zero, if HF has it
        if tmap.kind != "absent":
            shapes = hf_shapes(tmap, config)
            out.update(
                {n: torch.zeros(s, dtype=dtype) for n, s in zip(tmap.hf, shapes, strict=True)}
            )
    for hf_name, mega_name in mtp_copies(config, layout).items():
        out[hf_name] = state[mega_name].detach().contiguous().clone()
    return {name: out[name] for name in hf_tensor_names(config, layout)}


def write_safetensors(
    tensors: Mapping[str, Tensor], out_dir: str | Path, max_shard_size: int
) -> list[str]:
    """Write ``tensors`` as ``model.safetensors``, or as numbered shards plus an index when
    they exceed ``max_shard_size`` bytes (a larger tensor gets a shard of its own).

    Returns the file names written. Refuses a directory that already holds a checkpoint.
    """
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size ({max_shard_size}) must be a positive number of bytes")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(p.name for p in out.glob("model*.safetensors*"))
    if existing:
        raise ValueError(
            f"{out} already holds a checkpoint ({existing[0]}); choose an empty directory"
        )
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    from safetensors.torch import save_file  # optional dependency: mega-models[hf]

    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE), metadata={"format": "pt"})
        return [SINGLE]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for file, shard in zip(files, shards, strict=True):
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return [*files, INDEX]


_Config = TypeVar("_Config")


def source_state(
    source: Any,
    config: _Config | None,
    *,
    saver: str,
    model_type: type[nn.Module],
    split_dims: Sequence[str],
) -> tuple[dict[str, Tensor], _Config]:
    """The full tensors and the config of a ``saver`` source: a mapping of full tensors
    (``config`` then given), one unsplit model of ``model_type`` or a list of them covering
    every layer (split over none of ``split_dims``)."""
    if isinstance(source, Mapping):
        if config is None:
            raise ValueError(f"{saver} of a tensor mapping needs config=")
        return dict(source), config
    models: list[Any] = [source] if isinstance(source, model_type) else list(source)
    if not models:
        raise ValueError(f"{saver} got an empty list of models; pass every stage")
    for model, dim in ((m, d) for m in models for d in split_dims):
        size = model.groups.size(dim)
        if size != 1:
            raise ValueError(
                f"model is split over {dim} ({size}); call gather_full_state([model], pp_group) "
                "on every rank and pass its result from the first rank"
            )
    gathered = gather_full_state(models)
    assert gathered is not None
    return gathered, config if config is not None else cast(_Config, models[0].config)


def write_hf_folder(
    tensors: Mapping[str, Tensor], hf_config: Mapping[str, Any], out_dir: str | Path,
    max_shard_size: int,
) -> list[str]:  # fmt: skip
    """Write ``tensors`` as safetensors shards and ``hf_config`` as config.json; the file names."""
    files = write_safetensors(dict(tensors), out_dir, max_shard_size)
    text = json.dumps(hf_config, indent=2, sort_keys=True) + "\n"
    (Path(out_dir) / "config.json").write_text(text, encoding="utf-8")
    return ["config.json", *files]


def state_dtype_name(state: Mapping[str, Tensor]) -> str:
    """The dtype of the first tensor (float32 for none), as config.json names it."""
    first = next(iter(state.values()), None)
    return str(first.dtype if first is not None else torch.float32).removeprefix("torch.")


def save_hf_checkpoint(
    source: GPTModel | Sequence[GPTModel] | Mapping[str, Tensor],
    out_dir: str | Path,
    *,
    config: GPTConfig | None = None,
    architecture: str | None = None,
    base_config: str | Path | Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> list[str]:
    """Write a Hugging Face checkpoint (``config.json`` + safetensors) to ``out_dir``.

    ``source`` is a GPTModel built unsplit (tp, ep and etp 1), a list of such models
    covering every layer (pipeline stages or chunks built in this process), or a mapping
    of full tensors as :func:`~mega_models.hf.gather_full_state` returns on the first
    rank of a parallel run (then pass ``config``). ``architecture`` defaults to
    ``base_config``'s (the original config.json, whose keys the export does not own are
    kept: :func:`~mega_models.hf.hf_config_from_gpt`; one of another model's dimensions
    fails in one sentence), else to
    :func:`~mega_models.hf.default_architecture` (Llama, Qwen2, Mixtral or Qwen2-MoE).
    ``dtype`` casts floating tensors. Returns the names of the files written. Local:
    call it on one rank. HybridModels (or a HybridConfig's tensors) are written as
    ``NemotronHForCausalLM`` (:func:`~mega_models.hf.save_nemotron_h_checkpoint`).
    """
    lead = next(iter(source), None) if isinstance(source, Sequence) else source
    if isinstance(lead, HybridModel) or isinstance(config, HybridConfig):
        from mega_models.hf.nemotron_h import save_nemotron_h_checkpoint

        return save_nemotron_h_checkpoint(
            cast(Any, source), out_dir, config=cast(Any, config), base_config=base_config,
            dtype=dtype, max_shard_size=max_shard_size,
        )  # fmt: skip
    state, full = source_state(
        source, config, saver="save_hf_checkpoint", model_type=GPTModel,
        split_dims=("tp", "ep", "etp"),
    )  # fmt: skip
    base = None
    if base_config is not None:
        check_base_config(
            full, base_config, "pass the config.json this model was imported from, or none"
        )
        base = read_hf_config(base_config)
    arch = architecture or (
        hf_layout(base).architecture if base is not None else default_architecture(full)
    )
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    hf_config = hf_config_from_gpt(full, arch, dtype=state_dtype_name(state), base=base)
    tensors = hf_state_dict(state, full, hf_layout(hf_config))
    return write_hf_folder(tensors, hf_config, out_dir, max_shard_size)
