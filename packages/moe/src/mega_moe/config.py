"""The router and MoE-layer settings: frozen dataclasses, checked when they are built."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["ACTIVATIONS", "DISPATCHERS", "EXPERT_IMPLS", "MoEConfig", "RouterConfig"]

ScoreFunction = Literal["softmax", "sigmoid"]
DropPolicy = Literal["probs", "position"]
Activation = Literal["swiglu", "gelu"]
DispatcherName = Literal["alltoall", "allgather"]
ExpertImpl = Literal["grouped", "sequential"]
GroupedGemm = Literal["auto", "grouped_mm", "loop"]

#: Valid values of the string-valued settings.
ACTIVATIONS: tuple[str, ...] = ("swiglu", "gelu")
DISPATCHERS: tuple[str, ...] = ("alltoall", "allgather")
EXPERT_IMPLS: tuple[str, ...] = ("grouped", "sequential")
_SCORES = ("softmax", "sigmoid")
_DROPS = ("probs", "position")
_GEMMS = ("auto", "grouped_mm", "loop")


def _choice(name: str, value: object, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name} ({value!r}) must be one of {', '.join(map(repr, valid))}")


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} ({value!r}) must be a positive integer")


def _non_negative(name: str, value: float) -> None:
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"{name} ({value!r}) must be >= 0; use 0 to turn it off")


@dataclass(frozen=True)
class RouterConfig:
    """How tokens choose experts, and how the load is balanced (all routing math is fp32)."""

    num_experts: int
    """Number of routed experts E."""
    top_k: int
    """Experts each token is sent to."""
    score_function: ScoreFunction = "softmax"
    """``"softmax"`` (Mixtral, Qwen) or ``"sigmoid"`` (DeepSeek-V3) scores of the logits."""
    softmax_before_topk: bool = False
    """Softmax only. False: top-k of the logits, then softmax over the k chosen (Mixtral).
    True: softmax over all experts, then the top-k probabilities (Switch, Qwen, DeepSeek-V2)."""
    normalize_topk: bool = False
    """Divide the k chosen weights by their sum (DeepSeek-V3 sigmoid, Qwen ``norm_topk_prob``).
    Top-k-then-softmax weights already sum to one."""
    scaling_factor: float = 1.0
    """Multiplies the combine weights (DeepSeek-V3's ``routed_scaling_factor``)."""
    num_groups: int | None = None
    """Group-limited routing: the experts form this many equal groups (None: off)."""
    group_topk: int | None = None
    """Group-limited routing: a token picks its experts inside its best ``group_topk`` groups.
    A group scores the sum of its best ``group_score_topk`` expert scores."""
    group_score_topk: int | None = None
    """Group-limited routing: how many of a group's best expert scores its score sums. None:
    ``top_k // group_topk`` (Megatron-core's rule); DeepSeek-V3 and ``transformers`` sum the
    best 2 whatever ``top_k`` is (the two agree for DeepSeek-V3's top 8 of 4 groups)."""
    aux_loss_coeff: float = 0.0
    """Switch-style load-balancing loss ``coeff * E * sum_i f_i P_i`` (0: off)."""
    seq_aux_loss_coeff: float = 0.0
    """Sequence-level balancing loss (DeepSeek-V3), the same formula per sequence, averaged
    over the sequences (0: off)."""
    z_loss_coeff: float = 0.0
    """Router z-loss ``coeff * mean(logsumexp(logits)^2)`` (0: off)."""
    expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for the choice only
    (not to the weights), moved by ``update_expert_bias()`` toward balance."""
    bias_update_rate: float = 1e-3
    """Step of the expert-bias update: ``bias += rate * sign(mean_load - load)``."""
    capacity_factor: float | None = None
    """Token dropping: each expert takes at most ``ceil(factor * tokens * top_k / E)`` of a
    rank's tokens (None: no dropping, the default)."""
    drop_policy: DropPolicy = "probs"
    """Which tokens an over-full expert keeps: the highest weights (``"probs"``) or the
    first in token order (``"position"``)."""
    pad_to_capacity: bool = False
    """Pad every expert's input to exactly its capacity, so the expert GEMMs have fixed
    shapes (needs ``capacity_factor``; all-to-all dispatcher only)."""

    def __post_init__(self) -> None:
        _positive_int("num_experts", self.num_experts)
        _positive_int("top_k", self.top_k)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k ({self.top_k}) is larger than num_experts ({self.num_experts}); "
                f"choose top_k <= {self.num_experts}"
            )
        _choice("score_function", self.score_function, _SCORES)
        _choice("drop_policy", self.drop_policy, _DROPS)
        if not self.scaling_factor > 0.0:
            raise ValueError(f"scaling_factor ({self.scaling_factor!r}) must be > 0")
        for name in ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
            _non_negative(name, getattr(self, name))
        self._check_groups()
        if self.capacity_factor is not None and not self.capacity_factor > 0.0:
            raise ValueError(
                f"capacity_factor ({self.capacity_factor!r}) must be > 0; "
                "use None for no token dropping"
            )
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError(
                "pad_to_capacity=True needs a capacity_factor; set one, or turn padding off"
            )

    def _check_groups(self) -> None:
        groups, picked, summed = self.num_groups, self.group_topk, self.group_score_topk
        if groups is None and picked is None:
            if summed is not None:
                raise ValueError(
                    f"group_score_topk ({summed}) needs group-limited routing; set num_groups "
                    "and group_topk, or leave group_score_topk None"
                )
            return
        if groups is None or picked is None:
            raise ValueError(
                f"group-limited routing needs both num_groups ({groups}) and group_topk "
                f"({picked}); set both, or neither"
            )
        _positive_int("num_groups", groups)
        _positive_int("group_topk", picked)
        e, k = self.num_experts, self.top_k
        if e % groups:
            raise ValueError(
                f"num_experts ({e}) is not divisible by num_groups ({groups}); "
                "choose a divisor of num_experts"
            )
        if not picked <= min(groups, k):
            raise ValueError(
                f"group_topk ({picked}) must be at most num_groups ({groups}) and top_k ({k}); "
                "pick fewer groups"
            )
        if k > picked * (e // groups):
            raise ValueError(
                f"top_k ({k}) exceeds the {picked * (e // groups)} experts of the best "
                f"group_topk ({picked}) groups of {e // groups}; raise group_topk"
            )
        if summed is not None:
            _positive_int("group_score_topk", summed)
            if summed > e // groups:
                raise ValueError(
                    f"group_score_topk ({summed}) exceeds the {e // groups} experts of a group "
                    f"(num_experts {e} / num_groups {groups}); choose at most {e // groups}"
                )

    @property
    def group_scored_by(self) -> int:
        """How many best expert scores a group's score sums (group-limited routing only)."""
        assert self.group_topk is not None
        if self.group_score_topk is not None:
            return self.group_score_topk
        return self.top_k // self.group_topk

    def capacity(self, num_tokens: int) -> int | None:
        """Most tokens (of ``num_tokens`` routed on one rank) an expert takes; None: no limit."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer: a router, E experts of ``ffn_hidden_size``, optional shared experts."""

    router: RouterConfig
    """Routing and load balancing (holds ``num_experts`` and ``top_k``)."""
    ffn_hidden_size: int
    """Intermediate size of one routed expert."""
    activation: Activation = "swiglu"
    """``"swiglu"`` (gate and up projections) or ``"gelu"`` (tanh approximation)."""
    dispatcher: DispatcherName = "alltoall"
    """How tokens reach the experts over ep: ``"alltoall"`` or ``"allgather"``."""
    experts: ExpertImpl = "grouped"
    """``"grouped"`` (one grouped GEMM for all local experts) or ``"sequential"`` (a loop)."""
    grouped_gemm: GroupedGemm = "auto"
    """GroupedMLP kernel: ``torch._grouped_mm`` where it runs (``"auto"``), always it
    (``"grouped_mm"``), or a loop of GEMMs over the experts (``"loop"``)."""
    shared_ffn_size: int = 0
    """Intermediate size of the shared expert(s) every token goes through (0: none)."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output by ``sigmoid(x . w)`` per token (Qwen2-MoE)."""
    overlap_shared_experts: bool = False
    """Compute the shared experts while the dispatch all-to-all is in flight."""
    aux_loss_in_backward: bool = False
    """Add the router losses' gradients in backward through the layer output, scaled by
    ``layer.aux_loss_scale``, so pipeline stages that never see the loss still train them."""
    expert_fp8: bool = False
    """The routed experts' forward and input-gradient GEMMs in FP8 (e4m3, row-wise scales,
    weights quantised once a step; ``GroupedMLP(fp8=True)``). Needs ``experts="grouped"``."""

    def __post_init__(self) -> None:
        if not isinstance(self.router, RouterConfig):
            raise TypeError(
                f"router must be a RouterConfig, got {type(self.router).__name__}; "
                "pass router=RouterConfig(num_experts=..., top_k=...)"
            )
        _positive_int("ffn_hidden_size", self.ffn_hidden_size)
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("dispatcher", self.dispatcher, DISPATCHERS)
        _choice("experts", self.experts, EXPERT_IMPLS)
        _choice("grouped_gemm", self.grouped_gemm, _GEMMS)
        if not isinstance(self.shared_ffn_size, int) or self.shared_ffn_size < 0:
            raise ValueError(
                f"shared_ffn_size ({self.shared_ffn_size!r}) must be a non-negative integer; "
                "use 0 for no shared experts"
            )
        if self.shared_ffn_size == 0 and (self.shared_expert_gate or self.overlap_shared_experts):
            raise ValueError(
                "shared_expert_gate and overlap_shared_experts need shared experts, but "
                "shared_ffn_size is 0; set shared_ffn_size > 0 or turn them off"
            )
        if self.expert_fp8 and self.experts != "grouped":
            raise ValueError(
                f"expert_fp8 runs the grouped experts' GEMMs in fp8, but experts is "
                f"{self.experts!r}; use experts='grouped' or turn expert_fp8 off"
            )
        if self.router.pad_to_capacity and self.dispatcher != "alltoall":
            raise ValueError(
                f"pad_to_capacity works with the alltoall dispatcher, not {self.dispatcher!r}; "
                "use dispatcher='alltoall' or turn padding off"
            )

    @property
    def num_experts(self) -> int:
        """Number of routed experts E."""
        return self.router.num_experts

    @property
    def top_k(self) -> int:
        """Experts each token is sent to."""
        return self.router.top_k

    @property
    def gated(self) -> bool:
        """True for SwiGLU: the first projection has a gate and an up half."""
        return self.activation == "swiglu"
