"""The Mamba-2 mixer with its heads (and groups, conv channels, inner width) split over tp."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from mega_models.hybrid_config import HybridConfig
from mega_models.mixer_triton import causal_conv1d_silu, gated_rms_norm
from mega_models.norms import Ones
from mega_models.ssd import ssd_chunked
from mega_models.ssd_triton import ssd_triton, triton_available
from mega_parallel_grid import group_rank, group_size
from mega_tp_layers import (
    INIT_ATTR,
    ColumnParallelLinear,
    InitMethod,
    KeepsParamAttrs,
    Normal,
    RowParallelLinear,
    ScaledNormal,
    ShardSpec,
    Uniform,
    init_parameters,
    set_shard_spec,
)

__all__ = ["ALogInit", "DtBiasInit", "Mamba2Mixer"]


@dataclass(frozen=True)
class ALogInit:
    """``log(U(low, high))``: ``A = -exp(A_log)`` starts uniform in ``[-high, -low]``."""

    low: float
    high: float

    def __call__(self, full: Tensor, generator: torch.Generator) -> None:
        full.uniform_(self.low, self.high, generator=generator).log_()


@dataclass(frozen=True)
class DtBiasInit:
    """The inverse softplus of a step drawn log-uniform in ``[dt_min, dt_max]`` (floored)."""

    dt_min: float
    dt_max: float
    floor: float

    def __call__(self, full: Tensor, generator: torch.Generator) -> None:
        low, high = math.log(self.dt_min), math.log(self.dt_max)
        dt = full.uniform_(0.0, 1.0, generator=generator).mul_(high - low).add_(low).exp_()
        dt.clamp_(min=self.floor)
        full.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(full) == dt


class Mamba2Mixer(KeepsParamAttrs):
    """``[s(/tp), b, h] -> [s(/tp), b, h]``: in_proj (column), causal depthwise conv, SSD scan
    with a ``D`` skip, gated RMSNorm, out_proj (row).

    Each tp rank owns ``mamba_num_groups / tp`` whole groups: their heads, their B and C,
    their conv channels and their slice of the inner width. The full weights are laid out
    group by group so that an even split over tp gives every rank its groups, and so the
    full weights do not depend on tp: in_proj rows are, per group, ``z`` (its heads' inner
    channels), ``x`` (the same), ``B``, ``C``, ``dt`` (one per head); the conv channels
    are, per group, ``x``, ``B``, ``C``. The gated RMSNorm normalises each group's channels
    on their own (as Megatron's and mamba_ssm's grouped norm does), never across ranks.
    Under sequence parallelism the column layer all-gathers the sequence and the row layer
    reduce-scatters it back; the scan itself always sees whole sequences. Built on
    ``device`` and initialised from ``seed`` by parameter name (``init_parameters``); on
    the meta device nothing is drawn.
    """

    def __init__(
        self,
        config: HybridConfig,
        *,
        tp_group: ProcessGroup,
        sequence_parallel: bool = False,
        recompute_core: bool = False,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        c = config
        tp, rank = group_size(tp_group), group_rank(tp_group)
        if c.mamba_num_groups % tp:
            raise ValueError(
                f"mamba_num_groups ({c.mamba_num_groups}) is not divisible by tp ({tp}); "
                f"choose tp dividing {c.mamba_num_groups} or more groups"
            )
        self.groups = c.mamba_num_groups // tp  # groups on this rank
        self.heads_per_group = c.mamba_num_heads // c.mamba_num_groups
        self.heads = self.groups * self.heads_per_group
        self.head_dim, self.state_dim = c.mamba_head_dim, c.mamba_state_dim
        self.group_width = self.heads_per_group * self.head_dim  # inner channels per group
        self.conv_width, self.chunk_size = c.mamba_conv_width, c.mamba_chunk_size
        self.dt_limit, self.eps = c.mamba_dt_limit, c.norm_eps
        self.recompute_core = recompute_core
        if c.ssd_kernel == "triton" and not triton_available():
            raise ValueError(
                "ssd_kernel 'triton' needs the triton package, which is not installed; "
                "install triton or set ssd_kernel to 'auto' or 'torch'"
            )
        self.ssd_kernel = c.ssd_kernel
        if c.mixer_kernel == "triton" and not triton_available():
            raise ValueError(
                "mixer_kernel 'triton' needs the triton package, which is not installed; "
                "install triton or set mixer_kernel to 'auto' or 'torch'"
            )
        self.mixer_kernel = c.mixer_kernel
        meta = torch.device("meta")
        per_group = 2 * self.group_width + 2 * self.state_dim + self.heads_per_group
        common: dict[str, Any] = {"tp_group": tp_group, "sequence_parallel": sequence_parallel,
                                  "device": meta, "dtype": dtype, "bias": c.add_bias,
                                  "wgrad_fusion": True}  # fmt: skip
        self.in_proj = ColumnParallelLinear(
            c.hidden_size, c.mamba_num_groups * per_group, init_method=Normal(c.init_std),
            **common,
        )  # fmt: skip
        conv_per_group = self.group_width + 2 * self.state_dim
        conv_full = c.mamba_num_groups * conv_per_group
        bound = 1.0 / math.sqrt(c.mamba_conv_width)  # PyTorch's Conv1d default, fan_in = d_conv
        split: dict[str, Any] = {"tp": tp, "rank": rank, "device": meta, "dtype": dtype}
        self.conv_weight = _param((conv_full, c.mamba_conv_width), Uniform(-bound, bound), **split)
        self.conv_bias = (
            _param((conv_full,), Uniform(-bound, bound), **split) if c.mamba_conv_bias else None
        )
        heads = c.mamba_num_heads
        dt_init = DtBiasInit(c.mamba_dt_min, c.mamba_dt_max, c.mamba_dt_init_floor)
        self.dt_bias = _param((heads,), dt_init, **split)
        self.A_log = _param((heads,), ALogInit(*c.mamba_a_init_range), **split)
        self.D = _param((heads,), Ones(), **split)
        self.norm_weight = _param((c.mamba_inner,), Ones(), **split)
        self.out_proj = RowParallelLinear(
            c.mamba_inner, c.hidden_size, init_method=ScaledNormal(c.init_std, c.num_layers),
            **common,
        )  # fmt: skip
        if device is None or torch.device(device).type != "meta":
            self.to_empty(device=device if device is not None else "cpu")
            init_parameters(self, seed)

    def _fused(self, t: Tensor) -> bool:
        """Whether the conv and the gated norm run as the Triton kernels for input ``t``."""
        half = t.dtype in (torch.bfloat16, torch.float16)
        return self.mixer_kernel == "triton" or (
            self.mixer_kernel == "auto" and half and t.is_cuda and triton_available()
        )

    def _conv(self, xbc: Tensor) -> Tensor:
        """Causal depthwise convolution and SiLU over ``[s, b, g, w + 2n]`` (in_proj's slices
        as they are for the kernel; torch's conv1d takes ``[b, ch, s]``)."""
        if self._fused(xbc):
            return causal_conv1d_silu(xbc, self.conv_weight, self.conv_bias)
        s, b = xbc.shape[:2]
        w = self.conv_weight.unsqueeze(1)  # [ch, 1, k]
        seq_last = xbc.reshape(s, b, -1).permute(1, 2, 0)  # [s, b, ch] -> [b, ch, s]
        padded = F.pad(seq_last, (self.conv_width - 1, 0))
        out = F.conv1d(padded, w, self.conv_bias, groups=w.shape[0])  # [b, ch, s]
        return F.silu(out).permute(2, 0, 1).view(xbc.shape)  # -> [s, b, g, w + 2n]

    def _gated_norm(self, y: Tensor, z: Tensor) -> Tensor:
        """``rms_norm(y * silu(z)) * norm_weight`` per group: ``[s, b, g, w]``."""
        if self._fused(y):
            return gated_rms_norm(y, z, self.norm_weight, self.eps)
        gated = y * F.silu(z)
        return F.rms_norm(gated, (y.shape[-1],), eps=self.eps) * self.norm_weight.view(y.shape[2:])

    def _scan(self, x: Tensor, dt: Tensor, B: Tensor, C: Tensor) -> Tensor:
        """dt bounds, ``A``, the SSD scan (in fp32 at least) and the ``D`` skip:
        ``[s, b, heads, p]`` in the input's dtype."""
        work = torch.promote_types(x.dtype, torch.float32)
        step = F.softplus(dt.to(work) + self.dt_bias.to(work))  # [s, b, heads]
        step = step.clamp(min=self.dt_limit[0], max=self.dt_limit[1])
        A = -torch.exp(self.A_log.to(work))
        half = x.dtype in (torch.bfloat16, torch.float16)
        if self.ssd_kernel == "triton" or (
            self.ssd_kernel == "auto" and half and x.is_cuda and triton_available()
        ):  # the kernels read x, B and C in their dtype and accumulate in fp32
            return ssd_triton(x, step, A, B, C, self.chunk_size, D=self.D.to(work))
        xw = x.to(work)
        y = ssd_chunked(xw, step, A, B.to(work), C.to(work), self.chunk_size)
        y = y + xw * self.D.to(work)[:, None]
        return y.to(x.dtype)

    def forward(self, hidden: Tensor) -> Tensor:
        zxbcdt = self.in_proj(hidden)  # [s(/tp), b, h] -> [s, b, groups/tp * per_group]
        s, b = zxbcdt.shape[:2]
        g, w, n = self.groups, self.group_width, self.state_dim
        z, xbc, dt = torch.split(zxbcdt.view(s, b, g, -1), [w, w + 2 * n, self.heads_per_group], -1)
        xbc = self._conv(xbc)  # [s, b, g, w + 2n]
        x, B, C = torch.split(xbc, [w, n, n], dim=-1)
        x = x.reshape(s, b, self.heads, self.head_dim)  # [s, b, heads, p]
        dt = dt.reshape(s, b, self.heads)
        if self.recompute_core and self.training:
            y = checkpoint(self._scan, x, dt, B, C, use_reentrant=False)
        else:
            y = self._scan(x, dt, B, C)
        assert isinstance(y, Tensor)
        normed = self._gated_norm(y.reshape(s, b, g, w), z)  # per group of channels
        out: Tensor = self.out_proj(normed.view(s, b, g * w))  # -> [s(/tp), b, h]
        return out


def _param(
    full_shape: tuple[int, ...],
    init: InitMethod,
    *,
    tp: int,
    rank: int,
    device: torch.device,
    dtype: torch.dtype | None,
) -> nn.Parameter:
    """A parameter split over tp along dim 0, with its shard spec and init method."""
    spec = ShardSpec(0, tp, rank, "tp", full_shape, False)
    param = nn.Parameter(torch.empty(spec.local_shape, device=device, dtype=dtype))
    set_shard_spec(param, spec)
    setattr(param, INIT_ATTR, init)
    return param
