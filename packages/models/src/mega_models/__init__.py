"""GPT models on every parallel dimension: tp (+SP), cp, pp stages; exact FLOPs for MFU."""

from mega_models.config import GPTConfig
from mega_models.context_parallel import context_parallel_attention, zigzag_positions, zigzag_split
from mega_models.flops import forward_flops_per_token, matmul_params, model_flops_per_token
from mega_models.gpt import GPTModel
from mega_models.grads import finalize_model_grads
from mega_models.registry import MODEL_SIZES, model_config
from mega_models.stages import StageSpec, stage_spec

__all__ = [
    "MODEL_SIZES",
    "GPTConfig",
    "GPTModel",
    "StageSpec",
    "context_parallel_attention",
    "finalize_model_grads",
    "forward_flops_per_token",
    "matmul_params",
    "model_config",
    "model_flops_per_token",
    "stage_spec",
    "zigzag_positions",
    "zigzag_split",
]
