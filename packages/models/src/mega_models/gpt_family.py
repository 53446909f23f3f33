"""The GPT family (dense and MoE, with or without multi-token prediction): its ModelSpec."""

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
from mega_models.mtp import check_mtp_depth
from mega_models.mtp_flops import mtp_flops_per_token, mtp_matmul_params, mtp_norm_params
from mega_models.registry import MODEL_SIZES
from mega_models.spec import HFAdapter, LayoutRequest, ModelSpec, check_common_layout
from mega_models.stages import StageSpec
from mega_parallel_grid import ProcessGroups
from mega_tp_layers import Fp8Recipe

__all__ = ["GPT_SPEC"]


def _build(
    config: GPTConfig, groups: ProcessGroups, stage: StageSpec, *,
    fp8: bool | Fp8Recipe = False, **options: Any,
) -> GPTModel:  # fmt: skip
    recipe = fp8 if isinstance(fp8, Fp8Recipe) else Fp8Recipe() if fp8 else None
    return GPTModel(config, groups, stage=stage, fp8=recipe, **options)


def _flops_per_token(config: GPTConfig, seq_len: int) -> float:
    return model_flops_per_token(config, seq_len) + mtp_flops_per_token(config, seq_len)


def _matmul_params(config: GPTConfig) -> int:
    return matmul_params(config) + mtp_matmul_params(config)


def _check_layout(config: GPTConfig, request: LayoutRequest) -> None:
    check_common_layout(config, request)
    if config.mtp_num_layers:
        check_mtp_depth(config.mtp_num_layers, request.local_seq_len * request.parallel.cp)
        if config.position == "learned":
            raise ValueError(
                f"model.mtp_num_layers ({config.mtp_num_layers}) needs model.position rope or "
                "none: the MTP depths embed their tokens without the learned position table"
            )


def _config_from_hf(hf_dir: Path) -> GPTConfig:
    return gpt_config_from_hf(hf_dir)


GPT_SPEC: ModelSpec[GPTConfig] = ModelSpec(
    name="gpt",
    title="GPT",
    config_class=GPTConfig,
    model_class=GPTModel,
    sizes=MODEL_SIZES,
    flops_per_token=_flops_per_token,
    matmul_params=_matmul_params,
    build_chunk=_build,
    check_layout=_check_layout,
    extra_params=mtp_norm_params,
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
