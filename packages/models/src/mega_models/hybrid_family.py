"""The hybrid family (Mamba-2, attention, MLP and MoE layers by pattern): its ModelSpec."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mega_models.config import GPTConfig
from mega_models.hf.gather import gather_full_state
from mega_models.hf.nemotron_h import (
    check_nemotron_h_base,
    load_nemotron_h_weights,
    nemotron_h_config,
    save_nemotron_h_checkpoint,
)
from mega_models.hf.nemotron_h_config import NEMOTRON_H
from mega_models.hybrid import HybridModel
from mega_models.hybrid_config import HybridConfig
from mega_models.hybrid_flops import hybrid_flops_per_token, hybrid_matmul_params
from mega_models.hybrid_sizes import HYBRID_SIZES
from mega_models.spec import HFAdapter, LayoutRequest, ModelSpec, check_common_layout
from mega_models.stages import StageSpec
from mega_parallel_grid import ProcessGroups

__all__ = ["HYBRID_SPEC"]

_FP8 = (
    "train.fp8 is supported for GPT models only, not hybrid (Mamba) ones; turn fp8 off "
    "or choose a GPT size"
)
_TP_COMM_OVERLAP = (
    "parallel.tp_comm_overlap is supported for GPT models only, not hybrid (Mamba) ones; "
    "turn it off or choose a GPT size"
)

#: HybridConfig's Mamba-2 settings, taken from a registered hybrid of the same width.
_MAMBA_FIELDS = ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_expand",
                 "mamba_conv_width", "mamba_chunk_size")  # fmt: skip


def _check_layout(config: HybridConfig, request: LayoutRequest) -> None:
    """GPT's checks, the Mamba groups against tp, and what Mamba layers cannot do."""
    p = request.parallel
    check_common_layout(config, request)
    if config.mamba_num_groups % p.tp:
        raise ValueError(
            f"model.mamba_num_groups ({config.mamba_num_groups}) is not divisible by tp "
            f"({p.tp}); choose tp dividing {config.mamba_num_groups} or more groups"
        )
    if request.fp8:
        raise ValueError(_FP8)
    if request.tp_comm_overlap:
        raise ValueError(_TP_COMM_OVERLAP)
    if p.cp > 1:
        raise ValueError(f"cp ({p.cp}) > 1 is not supported for hybrid (Mamba) models; use cp = 1")


def _extra_params(config: HybridConfig) -> int:
    """Per Mamba layer: the depthwise convolution, dt bias, A, D and the gated norm."""
    c = config
    conv = c.mamba_inner + 2 * c.mamba_num_groups * c.mamba_state_dim
    per_layer = conv * (c.mamba_conv_width + int(c.mamba_conv_bias))
    per_layer += 3 * c.mamba_num_heads + c.mamba_inner
    return c.count("M") * per_layer


def _build(
    config: HybridConfig, groups: ProcessGroups, stage: StageSpec, *, fp8: bool = False,
    tp_comm_overlap: bool = False, cp_method: str = "ring", **options: Any,
) -> HybridModel:  # fmt: skip
    if fp8:
        raise ValueError(_FP8)
    if tp_comm_overlap:
        raise ValueError(_TP_COMM_OVERLAP)
    return HybridModel(config, groups, stage=stage, **options)


def _adopt(base: GPTConfig, overrides: Mapping[str, Any], size: str) -> HybridConfig | None:
    """A GPT size given ``model.pattern``: the hybrid of *that size's* dimensions.

    Its Mamba settings are those of the registered hybrid of the same hidden size (else
    HybridConfig's defaults), any of them overridable. The pattern must have one letter per
    layer of the size (or of ``model.num_layers`` when given); otherwise it is refused in one
    sentence, never shrunk to another size's dimensions.
    """
    if "pattern" not in overrides:
        return None
    pattern = overrides["pattern"]
    layers = overrides.get("num_layers", base.num_layers)
    if isinstance(pattern, str) and len(pattern) != layers:
        where = "model.num_layers" if "num_layers" in overrides else f"model.size {size}"
        raise ValueError(
            f"model.pattern {pattern!r} has {len(pattern)} layers but {where} has {layers}; "
            f"give a pattern of {layers} letters, set --model.num_layers {len(pattern)}, or "
            f"choose a hybrid size ({', '.join(HYBRID_SIZES)})"
        )
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    mamba = next((h for h in HYBRID_SIZES.values() if h.hidden_size == base.hidden_size), None)
    if mamba is not None:
        fields.update({k: getattr(mamba, k) for k in _MAMBA_FIELDS})
    fields.update(overrides)
    return HybridConfig(**fields)


def _config_from_hf(hf_dir: Path) -> HybridConfig:
    return nemotron_h_config(hf_dir)


def _check_base(config: GPTConfig, base: Path, way_out: str) -> None:
    if not isinstance(config, HybridConfig):
        raise TypeError(f"a {NEMOTRON_H} export needs a HybridConfig, got {type(config).__name__}")
    check_nemotron_h_base(config, base, way_out)


HYBRID_SPEC: ModelSpec[HybridConfig] = ModelSpec(
    name="hybrid",
    title="hybrid (Mamba)",
    config_class=HybridConfig,
    model_class=HybridModel,
    sizes=HYBRID_SIZES,
    flops_per_token=hybrid_flops_per_token,
    matmul_params=hybrid_matmul_params,
    build_chunk=_build,
    check_layout=_check_layout,
    extra_params=_extra_params,
    norms_per_layer=1,  # one pre-norm per layer
    adopt=_adopt,
    hf=HFAdapter(
        architectures=(NEMOTRON_H,),
        config_from_hf=_config_from_hf,
        load_weights=load_nemotron_h_weights,
        gather_state=gather_full_state,
        save=save_nemotron_h_checkpoint,
        check_base_config=_check_base,
    ),
)
