"""GPT (dense and MoE) and hybrid Mamba-2 models on every parallel dimension: tp (+SP), cp,
pp stages, ep; exact FLOPs for MFU; the Hugging Face bridge for Llama-family, Mixtral and
Qwen2-MoE checkpoints."""

import importlib.metadata

from mega_models.config import GPTConfig
from mega_models.context_parallel import context_parallel_attention, zigzag_positions, zigzag_split
from mega_models.flops import forward_flops_per_token, matmul_params, model_flops_per_token
from mega_models.forward_step import gpt_forward_step
from mega_models.gpt import GPTModel
from mega_models.grads import finalize_model_grads
from mega_models.head import lm_head
from mega_models.hf import (
    HF_ARCHITECTURES,
    gather_full_state,
    gpt_config_from_hf,
    hf_config_from_gpt,
    load_hf_weights,
    save_hf_checkpoint,
)
from mega_models.hybrid import HybridLayer, HybridModel
from mega_models.hybrid_config import LAYER_KINDS, HybridConfig
from mega_models.hybrid_flops import (
    hybrid_flops_per_token,
    hybrid_matmul_params,
    ssd_flops_per_token,
)
from mega_models.hybrid_sizes import HYBRID_SIZES, hybrid_config
from mega_models.mamba import ALogInit, DtBiasInit, Mamba2Mixer
from mega_models.mla import MultiLatentAttention
from mega_models.mtp import MTPDepth, mtp_labels
from mega_models.mtp_flops import mtp_flops_per_token
from mega_models.registry import MODEL_SIZES, model_config
from mega_models.spec import ModelSpec, all_specs, register_spec, resolve_model, spec_for
from mega_models.ssd import ssd_chunked, ssd_sequential
from mega_models.stages import StageSpec, stage_layer_counts, stage_spec

try:
    __version__ = importlib.metadata.version("mega-models")
except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "HF_ARCHITECTURES",
    "HYBRID_SIZES",
    "LAYER_KINDS",
    "MODEL_SIZES",
    "ALogInit",
    "DtBiasInit",
    "GPTConfig",
    "GPTModel",
    "HybridConfig",
    "HybridLayer",
    "HybridModel",
    "MTPDepth",
    "Mamba2Mixer",
    "ModelSpec",
    "MultiLatentAttention",
    "StageSpec",
    "__version__",
    "all_specs",
    "context_parallel_attention",
    "finalize_model_grads",
    "forward_flops_per_token",
    "gather_full_state",
    "gpt_config_from_hf",
    "gpt_forward_step",
    "hf_config_from_gpt",
    "hybrid_config",
    "hybrid_flops_per_token",
    "hybrid_matmul_params",
    "lm_head",
    "load_hf_weights",
    "matmul_params",
    "model_config",
    "model_flops_per_token",
    "mtp_flops_per_token",
    "mtp_labels",
    "register_spec",
    "resolve_model",
    "save_hf_checkpoint",
    "spec_for",
    "ssd_chunked",
    "ssd_flops_per_token",
    "ssd_sequential",
    "stage_layer_counts",
    "stage_spec",
    "zigzag_positions",
    "zigzag_split",
]
