"""Tensor- and sequence-parallel layers, vocab-parallel embedding and loss, shard metadata."""

import importlib.metadata

from mega_tp_layers.cross_entropy import vocab_parallel_cross_entropy
from mega_tp_layers.embedding import VocabParallelEmbedding
from mega_tp_layers.fp8 import (
    Fp8Recipe,
    Fp8Shard,
    fp8_gemm_supported,
    fp8_linear,
    fp8_linear_dgrad,
    fp8_linear_forward,
    fp8_linear_wgrad,
)
from mega_tp_layers.fp8_delayed import (
    Fp8AmaxHistory,
    Fp8Delayed,
    amax_history_for,
    delayed_for,
    discard_fp8_amaxes,
    fp8_amax_histories,
    recorded_amax,
    refresh_fp8_amax_histories,
    set_fp8_amax_recording,
    set_fp8_grad_unit,
    update_fp8_amax_histories,
)
from mega_tp_layers.fp8_recipe import check_amax_history, check_amax_interval, check_amax_margin
from mega_tp_layers.fp8_weight_cache import (
    Fp8WeightCache,
    WeightCache,
    cached_fp8_weight,
    fp8_weight_caches,
    invalidate_fp8_weight_caches,
    weight_cache_for,
)
from mega_tp_layers.fused_cross_entropy import fused_linear_cross_entropy
from mega_tp_layers.grads import (
    SEQUENCE_PARALLEL_ATTR,
    all_reduce_coalesced,
    gradient_of,
    mark_sequence_parallel,
    sync_sequence_parallel_grads,
)
from mega_tp_layers.init import (
    INIT_ATTR,
    InitMethod,
    Normal,
    PaddedRows,
    ScaledNormal,
    Uniform,
    XavierUniform,
    Zeros,
    init_full,
    init_parameter,
    init_parameters,
    param_generator,
)
from mega_tp_layers.linear import ColumnParallelLinear, RowParallelLinear, column_parallel_linear
from mega_tp_layers.main_grad_fusion import (
    MAIN_GRAD_ALPHA_ATTR,
    WGRAD_FUSION_ATTR,
    linear_into_main_grad,
    register_wgrad_target,
)
from mega_tp_layers.mappings import (
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
)
from mega_tp_layers.params import KeepsParamAttrs, ShardedModule, creation_generator
from mega_tp_layers.rng import TP_RNG, RNGStatesTracker, tp_rng_tracker
from mega_tp_layers.shard import (
    SHARD_ATTR,
    ShardSpec,
    gather_full,
    mark_replicated,
    set_shard_spec,
    shard_spec,
    shard_tensor,
    unshard,
)
from mega_tp_layers.te_backend import BACKENDS, Backend, fp8_autocast, te_available
from mega_tp_layers.vocab import padded_vocab_size, vocab_range
from mega_tp_layers.wgrad import (
    WeightGradStore,
    current_weight_grad_store,
    defer_weight_grads,
    split_linear,
)

try:
    __version__ = importlib.metadata.version("mega-tp-layers")
except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "BACKENDS",
    "INIT_ATTR",
    "MAIN_GRAD_ALPHA_ATTR",
    "SEQUENCE_PARALLEL_ATTR",
    "SHARD_ATTR",
    "TP_RNG",
    "WGRAD_FUSION_ATTR",
    "Backend",
    "ColumnParallelLinear",
    "Fp8AmaxHistory",
    "Fp8Delayed",
    "Fp8Recipe",
    "Fp8Shard",
    "Fp8WeightCache",
    "InitMethod",
    "KeepsParamAttrs",
    "Normal",
    "PaddedRows",
    "RNGStatesTracker",
    "RowParallelLinear",
    "ScaledNormal",
    "ShardSpec",
    "ShardedModule",
    "Uniform",
    "VocabParallelEmbedding",
    "WeightCache",
    "WeightGradStore",
    "XavierUniform",
    "Zeros",
    "__version__",
    "all_reduce_coalesced",
    "amax_history_for",
    "cached_fp8_weight",
    "check_amax_history",
    "check_amax_interval",
    "check_amax_margin",
    "column_parallel_linear",
    "copy_to_tp_region",
    "creation_generator",
    "current_weight_grad_store",
    "defer_weight_grads",
    "delayed_for",
    "discard_fp8_amaxes",
    "fp8_amax_histories",
    "fp8_autocast",
    "fp8_gemm_supported",
    "fp8_linear",
    "fp8_linear_dgrad",
    "fp8_linear_forward",
    "fp8_linear_wgrad",
    "fp8_weight_caches",
    "fused_linear_cross_entropy",
    "gather_from_sequence_region",
    "gather_from_tp_region",
    "gather_full",
    "gradient_of",
    "init_full",
    "init_parameter",
    "init_parameters",
    "invalidate_fp8_weight_caches",
    "linear_into_main_grad",
    "mark_replicated",
    "mark_sequence_parallel",
    "padded_vocab_size",
    "param_generator",
    "recorded_amax",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region",
    "refresh_fp8_amax_histories",
    "register_wgrad_target",
    "scatter_to_sequence_region",
    "scatter_to_tp_region",
    "set_fp8_amax_recording",
    "set_fp8_grad_unit",
    "set_shard_spec",
    "shard_spec",
    "shard_tensor",
    "split_linear",
    "sync_sequence_parallel_grads",
    "te_available",
    "tp_rng_tracker",
    "unshard",
    "update_fp8_amax_histories",
    "vocab_parallel_cross_entropy",
    "vocab_range",
    "weight_cache_for",
]
