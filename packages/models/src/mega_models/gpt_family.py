"""The GPT family (dense and MoE): its ModelSpec."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mega_models.config import GPTConfig
from mega_models.flops import matmul_params, model_flops_per_token
from mega_models.gpt import GPTModel
from mega_models.hf import (
    HF_ARCHITECTURES,
    check_base_config,
    gather_full_state,
    gpt_config_from_hf,
    load_hf_weights,
    save_hf_checkpoint,
)
from mega_models.registry import MODEL_SIZES
from mega_models.spec import HFAdapter, ModelSpec, check_common_layout
from mega_models.stages import StageSpec
from mega_parallel_grid import ProcessGroups
from mega_tp_layers import Fp8Recipe

__all__ = ["GPT_SPEC"]


def _build(
    config: GPTConfig, groups: ProcessGroups, stage: StageSpec, *, fp8: bool = False, **options: Any
) -> GPTModel:
    return GPTModel(config, groups, stage=stage, fp8=Fp8Recipe() if fp8 else None, **options)


def _config_from_hf(hf_dir: Path) -> GPTConfig:
    return gpt_config_from_hf(hf_dir)


GPT_SPEC: ModelSpec[GPTConfig] = ModelSpec(
    name="gpt",
    title="GPT",
    config_class=GPTConfig,
    model_class=GPTModel,
    sizes=MODEL_SIZES,
    flops_per_token=model_flops_per_token,
    matmul_params=matmul_params,
    build_chunk=_build,
    check_layout=check_common_layout,
    norms_per_layer=2,
    hf=HFAdapter(
        architectures=tuple(HF_ARCHITECTURES),
        config_from_hf=_config_from_hf,
        load_weights=load_hf_weights,
        gather_state=gather_full_state,
        save=save_hf_checkpoint,
        check_base_config=check_base_config,
    ),
)
