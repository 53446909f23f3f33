"""HybridConfig: a GPT config plus a layer pattern and the sizes of its Mamba-2 layers."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from mega_models.config import GPTConfig

__all__ = ["LAYER_KINDS", "HybridConfig"]

#: One letter per layer, as in Megatron's hybrid pattern.
LAYER_KINDS: dict[str, str] = {
    "M": "Mamba-2 mixer",
    "*": "self-attention",
    "-": "MLP",
    "E": "mixture of experts",
}


@dataclass(frozen=True)
class HybridConfig(GPTConfig):
    """A pre-norm decoder whose layers follow ``pattern``, one letter a layer.

    ``M`` is a Mamba-2 mixer, ``*`` self-attention, ``-`` an MLP, ``E`` a mixture of
    experts (each ``x + f(norm(x))``). The GPT fields size the attention, MLP and MoE
    layers, the embedding and the output; ``num_layers`` must equal ``len(pattern)``
    (``replace(pattern=...)`` sets it from the pattern when it is not given).

    The ``E`` letters alone say which layers are MoE: GPT's ``moe_layer_freq`` and
    ``moe_layer_pattern`` do not apply and must keep their defaults (1 and None). A
    pattern with an ``E`` needs ``num_experts > 0``, and ``num_experts > 0`` needs an
    ``E``; the other ``moe_*`` fields set up the experts and the router as for GPT.
    """

    pattern: str = "M*M-"
    """Layer kinds in order: ``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` MoE."""
    mamba_state_dim: int = 16
    """State channels per group (``d_state``, N)."""
    mamba_head_dim: int = 16
    """Channels per Mamba head (P)."""
    mamba_num_groups: int = 2
    """Groups sharing one B and one C (``ngroups``); tp must divide it."""
    mamba_expand: int = 2
    """Inner width = ``mamba_expand * hidden_size`` unless ``mamba_inner_size`` is set."""
    mamba_inner_size: int | None = None
    """Inner width (``d_inner`` = Mamba heads x ``mamba_head_dim``) when it is not
    ``mamba_expand * hidden_size`` (Nemotron-H gives its head count); None: the product."""
    mamba_conv_width: int = 4
    """Kernel size of the causal depthwise convolution (``d_conv``)."""
    mamba_chunk_size: int = 16
    """Steps per chunk of the SSD scan (the sequence is padded to a multiple)."""
    mamba_dt_min: float = 0.001
    """Smallest initial step size (dt is drawn log-uniform in [dt_min, dt_max])."""
    mamba_dt_max: float = 0.1
    """Largest initial step size."""
    mamba_dt_init_floor: float = 1e-4
    """Initial steps below this are raised to it."""
    mamba_dt_limit: tuple[float, float] = (0.0, math.inf)
    """Bounds dt is clamped to after ``softplus(dt + dt_bias)``."""
    mamba_a_init_range: tuple[float, float] = (1.0, 16.0)
    """``-A`` is drawn uniform in this range (stored as ``A_log = log(-A)``)."""
    mamba_conv_bias: bool = True
    """Bias in the depthwise convolution."""
    ssd_kernel: str = "auto"
    """The SSD scan's implementation: ``"triton"`` (the project's kernels,
    ``mega_models.ssd_triton``), ``"torch"`` (``ssd_chunked``), or ``"auto"``: triton for
    bf16/fp16 CUDA tensors when the triton package is installed, torch otherwise (fp32 and
    fp64 kernels run their matmuls without tensor cores: correct, not fast)."""
    mixer_kernel: str = "auto"
    """The Mamba mixer's causal conv + SiLU and gated RMSNorm: ``"triton"`` (the project's
    fused kernels, ``mega_models.mixer_triton``), ``"torch"`` (conv1d, silu, rms_norm), or
    ``"auto"``: triton for bf16/fp16 CUDA tensors when the triton package is installed,
    torch otherwise."""

    def __post_init__(self) -> None:
        for name in ("mamba_dt_limit", "mamba_a_init_range"):  # TOML and JSON give lists
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        # before GPT's MoE checks, which would read moe_layer_pattern as the MoE layers
        if self.moe_layer_pattern is not None:
            raise ValueError(
                f"moe_layer_pattern ({self.moe_layer_pattern!r}) does not apply to hybrid "
                "models; leave it None and mark the MoE layers with 'E' in pattern"
            )
        if self.moe_layer_freq != 1:
            raise ValueError(
                f"moe_layer_freq ({self.moe_layer_freq!r}) does not apply to hybrid models; "
                "leave it at 1 and mark the MoE layers with 'E' in pattern"
            )
        if self.mtp_num_layers != 0:
            raise ValueError(
                f"mtp_num_layers ({self.mtp_num_layers!r}) is not supported by hybrid models "
                "(multi-token prediction is built for the GPT family); set it to 0"
            )
        if self.attention != "mha":
            raise ValueError(
                f"attention ({self.attention!r}) is not supported by hybrid models, whose "
                "attention layers are standard (GQA) self-attention; set attention to 'mha'"
            )
        super().__post_init__()
        p = self.pattern
        if not isinstance(p, str) or not p:
            raise ValueError(f"pattern ({p!r}) must be a non-empty string such as 'M*M-'")
        unknown = sorted({ch for ch in p if ch not in LAYER_KINDS})
        if unknown:
            known = ", ".join(f"{k!r} {v}" for k, v in LAYER_KINDS.items())
            raise ValueError(
                f"pattern {p!r} has unknown layer letters {', '.join(map(repr, unknown))}; "
                f"use {known}"
            )
        if "E" in p and self.num_experts == 0:
            raise ValueError(
                f"pattern {p!r} has an MoE layer at position {p.index('E')} but num_experts "
                "is 0; set num_experts (and moe_top_k) or use '-' for a dense MLP"
            )
        if "E" not in p and self.num_experts > 0:
            raise ValueError(
                f"num_experts ({self.num_experts}) is set but pattern {p!r} has no MoE "
                "layer; put an 'E' in the pattern or set num_experts to 0"
            )
        if len(p) != self.num_layers:
            raise ValueError(
                f"pattern {p!r} has {len(p)} layers but num_layers is {self.num_layers}; "
                "make them equal"
            )
        for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_expand",
                     "mamba_conv_width", "mamba_chunk_size"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be a positive integer")
        inner = self.mamba_inner_size
        if inner is not None and (not isinstance(inner, int) or isinstance(inner, bool)
                                  or inner < 1):  # fmt: skip
            raise ValueError(f"mamba_inner_size ({inner!r}) must be a positive integer or None")
        if self.mamba_inner % self.mamba_head_dim:
            width = (f"mamba_inner_size {inner}" if inner is not None else
                     f"{self.mamba_expand} * {self.hidden_size} = {self.mamba_inner}")  # fmt: skip
            raise ValueError(
                f"the Mamba inner width ({width}) is not divisible by mamba_head_dim "
                f"({self.mamba_head_dim}); change mamba_head_dim or "
                f"{'mamba_inner_size' if inner is not None else 'mamba_expand'}"
            )
        if self.mamba_num_heads % self.mamba_num_groups:
            raise ValueError(
                f"Mamba heads ({self.mamba_num_heads}) are not divisible by mamba_num_groups "
                f"({self.mamba_num_groups}); choose a group count dividing the head count"
            )
        if not 0.0 < self.mamba_dt_min <= self.mamba_dt_max:
            raise ValueError(
                f"mamba_dt_min ({self.mamba_dt_min}) and mamba_dt_max ({self.mamba_dt_max}) "
                "must satisfy 0 < dt_min <= dt_max"
            )
        low, high = self.mamba_dt_limit
        if not 0.0 <= low < high:
            raise ValueError(f"mamba_dt_limit ({low}, {high}) must satisfy 0 <= low < high")
        if self.ssd_kernel not in ("auto", "triton", "torch"):
            raise ValueError(
                f"ssd_kernel ({self.ssd_kernel!r}) must be 'auto', 'triton' or 'torch'"
            )
        if self.mixer_kernel not in ("auto", "triton", "torch"):
            raise ValueError(
                f"mixer_kernel ({self.mixer_kernel!r}) must be 'auto', 'triton' or 'torch'"
            )
        a_low, a_high = self.mamba_a_init_range
        if not 0.0 < a_low <= a_high:
            raise ValueError(f"mamba_a_init_range ({a_low}, {a_high}) must satisfy 0 < low <= high")

    @property
    def mamba_inner(self) -> int:
        """Inner width of a Mamba layer (``d_inner``)."""
        if self.mamba_inner_size is not None:
            return self.mamba_inner_size
        return self.mamba_expand * self.hidden_size

    @property
    def mamba_num_heads(self) -> int:
        """Mamba heads: inner width / head dim."""
        return self.mamba_inner // self.mamba_head_dim

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (global, from 0) is an MoE layer: ``pattern[index] == 'E'``."""
        return self.pattern[index] == "E"

    def count(self, kind: str) -> int:
        """How many layers of one kind (a pattern letter) the model has."""
        return self.pattern.count(kind)

    def replace(self, **changes: Any) -> HybridConfig:
        """A copy with some fields changed (validated again); a new ``pattern`` without
        ``num_layers`` also sets ``num_layers`` to its length."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(
                f"HybridConfig has no field {', '.join(unknown)}; "
                f"known fields: {', '.join(sorted(known))}"
            )
        if "pattern" in changes and "num_layers" not in changes:
            changes["num_layers"] = len(str(changes["pattern"]))
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return HybridConfig(**values)
