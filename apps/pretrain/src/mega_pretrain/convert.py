"""``mega-pretrain convert``: Hugging Face checkpoints to mega run folders and back.

uv run mega-pretrain convert --from-hf llama-dir --to runs/llama   [--tp 2 --pp 2 under torchrun]
uv run mega-pretrain --config runs/llama/model.toml                # continue training it
uv run mega-pretrain convert --to-hf hf-out --from runs/llama      # export the latest checkpoint

The import keeps the model folder's config.json, generation_config.json and tokenizer files
in ``<run>/hf/``; the export writes every key of that config.json it does not own (token ids
and the rest; it owns the shape keys it derives from the model) and copies the other files,
so what the import read comes back out. A run trained from scratch has no ``hf/`` and
exports with a config.json of the model's keys alone.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mega_models.hf import copy_side_files
from mega_models.spec import HFAdapter, hf_spec, spec_for
from mega_parallel_grid import init_process_groups
from mega_pretrain.build import build, gpt_config
from mega_pretrain.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from mega_pretrain.config import TrainerConfig, config_to_dict, load_config
from mega_pretrain.runtime import (
    collective_timeout,
    pick_device,
    start_distributed,
    world_size_from_env,
)
from mega_pretrain.validate import check_config

__all__ = ["from_hf", "to_hf"]

#: The folder of a run that holds the imported model's config.json and tokenizer files.
KEPT_DIR = "hf"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple | list):  # a HybridConfig's (low, high) ranges
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def _start(config: TrainerConfig) -> tuple[Any, torch.device]:
    plan = check_config(config, gpt_config(config), world_size_from_env())
    device = pick_device(config.run.device)
    timeout = collective_timeout(config.run.timeout_minutes)
    start_distributed(device, timeout)
    return init_process_groups(plan.parallel, timeout=timeout), device


def _adapter(config: TrainerConfig) -> HFAdapter:
    """The Hugging Face adapter of the config's model family; one sentence if it has none."""
    spec = spec_for(gpt_config(config))
    if spec.hf is None:
        raise ValueError(
            f"only GPT (Llama-family) models convert to Hugging Face; this run is a "
            f"{spec.title or spec.name} model, whose family has no Hugging Face adapter"
        )
    return spec.hf


def from_hf(hf_dir: Path, run_dir: Path, overrides: list[tuple[str, str]]) -> Path:
    """Import ``hf_dir`` at the layout of ``overrides`` into a step-0 checkpoint of ``run_dir``.

    Also writes ``run_dir/model.toml``: a config whose ``[model]`` is the imported shape and
    whose ``[run]`` points at ``run_dir``, so ``mega-pretrain --config`` continues from it.
    """
    hf = hf_spec(hf_dir).hf
    assert hf is not None  # hf_spec returns a family with an adapter
    shape = hf.config_from_hf(hf_dir)
    fields = {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)}
    run = [("run.out_dir", str(run_dir.parent)), ("run.name", run_dir.name)]
    model = [(f"model.{k}", _toml_value(v).strip('"')) for k, v in fields.items() if v is not None]
    config = load_config(None, [*model, *run, *overrides])
    groups, device = _start(config)
    built = build(config, groups, device)
    for chunk in built.chunks:
        hf.load_weights(chunk, hf_dir)
    built.optimizer.reload_model_params()
    state = {
        "step": 0,
        "consumed_samples": 0,
        "config": config_to_dict(config),
        "imported_from": str(hf_dir),
    }
    path = save_checkpoint(run_dir, 0, built, groups, state, keep_last=config.checkpoint.keep_last)
    if dist.get_rank() == 0:
        lines = [
            "# written by mega-pretrain convert --from-hf; continue with --config this file",
            "[model]",
        ]
        lines += [f"{k} = {_toml_value(v)}" for k, v in fields.items() if v is not None]
        lines += [
            "",
            "[run]",
            f"out_dir = {_toml_value(str(run_dir.parent))}",
            f"name = {_toml_value(run_dir.name)}",
        ]
        (run_dir / "model.toml").write_text("\n".join(lines) + "\n")
        copy_side_files(hf_dir, run_dir / KEPT_DIR)
    return path


def _run_dir(source: Path) -> Path:
    """The run folder of a checkpoint folder ``<run>/checkpoints/step_N``."""
    return source.parent.parent if source.parent.name == "checkpoints" else source


def to_hf(run_or_checkpoint: Path, out_dir: Path, overrides: list[tuple[str, str]]) -> Path:
    """Export a mega checkpoint (a run folder's latest, or a checkpoint folder) as HF safetensors,
    with the config.json keys, generation config and tokenizer files the import kept."""
    source = (
        latest_checkpoint(run_or_checkpoint)
        if (run_or_checkpoint / "checkpoints").is_dir()
        else run_or_checkpoint
    )
    if source is None:
        raise ValueError(
            f"{run_or_checkpoint} holds no checkpoint; pass a run folder or a checkpoint folder"
        )
    meta_path = source / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{source} is not a mega checkpoint (no meta.json)")
    saved = json.loads(meta_path.read_text())["trainer_state"]["config"]
    model = [
        (f"model.{k}", _toml_value(v).strip('"'))
        for k, v in saved["model"]["overrides"].items()
        if v is not None
    ]
    config = load_config(None, [("model.size", saved["model"]["size"]), *model, *overrides])
    kept = _run_dir(source) / KEPT_DIR
    base = kept / "config.json" if (kept / "config.json").is_file() else None
    hf = _adapter(config)  # on every rank, before any collective
    if base is not None:
        hf.check_base_config(
            gpt_config(config), base, f"delete {kept} to export without the imported config"
        )
    groups, device = _start(config)
    built = build(config, groups, device)
    load_checkpoint(source, built, groups)
    state = hf.gather_state(built.chunks, groups.pp)
    if dist.get_rank() == 0 and groups.rank("dp") == 0:
        assert state is not None
        hf.save(state, out_dir, config=gpt_config(config), base_config=base)
        copy_side_files(kept, out_dir, skip=("config.json",))
    dist.barrier()
    return out_dir
