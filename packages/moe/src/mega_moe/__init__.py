"""Mixture-of-experts layers: top-k routers, token dispatchers, grouped experts, ep and etp."""

import importlib.metadata

from mega_moe.collect import moe_aux_loss, moe_tokens_per_expert, update_expert_biases
from mega_moe.config import ACTIVATIONS, DISPATCHERS, EXPERT_IMPLS, MoEConfig, RouterConfig
from mega_moe.dispatcher import AllGatherDispatcher, AllToAllDispatcher, Dispatched
from mega_moe.expert_shard import EXPERT_ATTR, ExpertShard, expert_shard, gather_expert_weight
from mega_moe.experts import EtpSlice, GroupedMLP, SequentialMLP
from mega_moe.flops import moe_activated_params, moe_flops_per_token
from mega_moe.fp8_expert_weights import Fp8ExpertWeights
from mega_moe.layer import MoELayer
from mega_moe.recompute import is_recomputing, recomputing
from mega_moe.router import Routing, RoutingStats, TopKRouter
from mega_moe.shared import SharedExpertMLP
from mega_moe.wgrad_accum import MAIN_GRAD_ALPHA_ATTR, WGRAD_FUSION_ATTR, grouped_wgrad_accumulate

try:
    __version__ = importlib.metadata.version("mega-moe")
except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "ACTIVATIONS",
    "DISPATCHERS",
    "EXPERT_ATTR",
    "EXPERT_IMPLS",
    "MAIN_GRAD_ALPHA_ATTR",
    "WGRAD_FUSION_ATTR",
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "Dispatched",
    "EtpSlice",
    "ExpertShard",
    "Fp8ExpertWeights",
    "GroupedMLP",
    "MoEConfig",
    "MoELayer",
    "RouterConfig",
    "Routing",
    "RoutingStats",
    "SequentialMLP",
    "SharedExpertMLP",
    "TopKRouter",
    "__version__",
    "expert_shard",
    "gather_expert_weight",
    "grouped_wgrad_accumulate",
    "is_recomputing",
    "moe_activated_params",
    "moe_aux_loss",
    "moe_flops_per_token",
    "moe_tokens_per_expert",
    "recomputing",
    "update_expert_biases",
]
