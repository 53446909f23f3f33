"""Self-attention with heads split over tp, GQA, RoPE, optional QK-norm and context parallel."""

from __future__ import annotations

import abc
import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from mega_models.config import GPTConfig
from mega_models.context_parallel import context_parallel_attention
from mega_models.doc_mask import DocumentMask, document_attention
from mega_models.fused_ops import rope_qk, run_fused
from mega_models.norms import Norm
from mega_models.rng_replay import rng_checkpoint_contexts
from mega_parallel_grid import group_size
from mega_tp_layers import (
    ColumnParallelLinear,
    Fp8Recipe,
    Normal,
    RNGStatesTracker,
    RowParallelLinear,
    ScaledNormal,
)

__all__ = ["AttentionBase", "SelfAttention", "dropout_rng", "run_core"]


def _core_replaying_rng_eager(
    core: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_len: int,
    rng: RNGStatesTracker,
) -> torch.Tensor:
    """The attention core recomputed in backward with the dropout masks of its forward."""
    out = checkpoint(
        core, q, k, v, seq_len, use_reentrant=False, context_fn=rng_checkpoint_contexts(rng)
    )
    assert isinstance(out, torch.Tensor)
    return out


@functools.cache
def _core_replaying_rng_disabled() -> Callable[..., torch.Tensor]:
    """:func:`_core_replaying_rng_eager` kept out of dynamo, which cannot trace checkpoint's
    ``context_fn``. Wrapped on first use: ``torch.compiler.disable`` imports dynamo
    (seconds), which ``import mega_models`` does not pay."""
    disabled: Callable[..., torch.Tensor] = torch.compiler.disable(  # type: ignore[no-untyped-call]
        _core_replaying_rng_eager
    )
    return disabled


def _core_replaying_rng(
    core: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_len: int,
    rng: RNGStatesTracker,
) -> torch.Tensor:
    """:func:`_core_replaying_rng_eager`, run eagerly under ``torch.compile`` too."""
    if torch.compiler.is_compiling():
        return _core_replaying_rng_disabled()(core, q, k, v, seq_len, rng)
    return _core_replaying_rng_eager(core, q, k, v, seq_len, rng)


def dropout_rng(rng: RNGStatesTracker | None, p: float) -> AbstractContextManager[object]:
    """The tracked RNG's fork while attention dropout acts (heads differ per tp rank: so
    must their masks), else nothing."""
    return rng.fork() if p > 0.0 and rng is not None else contextlib.nullcontext()


def run_core(
    core: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_len: int,
    recompute: bool,
    rng: RNGStatesTracker | None,
    dropout: float,
) -> torch.Tensor:
    """``core(q, k, v, seq_len)``, or recomputed in backward (selective recompute) with the
    dropout masks of its forward replayed from the tracked RNG."""
    if not recompute:
        return core(q, k, v, seq_len)
    if rng is not None and dropout > 0.0:
        return _core_replaying_rng(core, q, k, v, seq_len, rng)
    out = checkpoint(core, q, k, v, seq_len, use_reentrant=False)
    assert isinstance(out, torch.Tensor)
    return out


class AttentionBase(nn.Module, abc.ABC):
    """The set-up every attention layer shares: its groups, heads per tp rank, dropout and
    recompute settings; then ``_build(config, linear)`` makes the layer's weights, with
    ``linear`` the factory arguments of its tp linears (``tp_group``, ``sequence_parallel``,
    ``device``, ``dtype``, ``fp8``, ``tp_comm_overlap``)."""

    def __init__(
        self,
        config: GPTConfig,
        *,
        tp_group: ProcessGroup,
        cp_group: ProcessGroup,
        sequence_parallel: bool,
        cp_method: Literal["ring", "all_gather"] = "ring",
        recompute_core: bool = False,
        rng: RNGStatesTracker | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        fp8: Fp8Recipe | None = None,
        tp_comm_overlap: bool = False,
    ) -> None:
        super().__init__()
        self._check(config)
        tp = group_size(tp_group)
        self.tp_group, self.tp, self.cp = tp_group, tp, group_size(cp_group)
        self.cp_group, self.cp_method = cp_group, cp_method
        self.sequence_parallel = sequence_parallel
        self.heads = config.num_attention_heads // tp
        self.dropout, self.recompute_core, self.rng = config.attention_dropout, recompute_core, rng
        self.fused = config.fused_elementwise  # RoPE as one compiled region (fused_ops)
        linear: dict[str, Any] = {"tp_group": tp_group, "sequence_parallel": sequence_parallel,
                  "device": device, "dtype": dtype, "fp8": fp8,
                  "tp_comm_overlap": tp_comm_overlap,
                  "wgrad_fusion": True}  # fmt: skip
        self._build(config, linear)

    def _check(self, config: GPTConfig) -> None:
        """Raise for a config this layer does not build."""

    @abc.abstractmethod
    def _build(self, config: GPTConfig, linear: dict[str, Any]) -> None:
        """Make the layer's weights (each subclass its own)."""


class SelfAttention(AttentionBase):
    """``[s(/tp), b, h] -> [s(/tp), b, h]``: fused QKV column GEMM, core attention, row GEMM.

    The fused QKV weight's full layout is grouped by key/value head: for each KV group,
    its query heads, then its key head, then its value head. Splitting those rows evenly
    over tp gives each rank whole KV groups, so the full weight is the same at any tp.
    """

    def _check(self, config: GPTConfig) -> None:
        if config.attention != "mha":
            raise ValueError(
                f"SelfAttention builds standard attention, but config.attention is "
                f"{config.attention!r}; build MultiLatentAttention for it (TransformerLayer "
                "picks it), or set attention = 'mha'"
            )

    def _build(self, config: GPTConfig, linear: dict[str, Any]) -> None:
        c = config
        self.kv_heads = c.kv_heads // self.tp
        self.head_dim = c.head_dim
        common = {**linear, "bias": c.add_bias}
        qkv_out = (c.num_attention_heads + 2 * c.kv_heads) * c.head_dim
        self.qkv = ColumnParallelLinear(
            c.hidden_size, qkv_out, init_method=Normal(c.init_std),
            **{**common, "bias": c.add_bias or c.qkv_bias},
        )  # fmt: skip
        self.proj = RowParallelLinear(
            c.num_attention_heads * c.head_dim, c.hidden_size,
            init_method=ScaledNormal(c.init_std, c.num_layers), **common,
        )  # fmt: skip
        self.q_norm = self.k_norm = None
        if c.qk_norm:
            kw: dict[str, Any] = {
                "device": linear["device"],
                "dtype": linear["dtype"],
                "tp_group": self.tp_group,
                "partial_grads": True,
            }
            self.q_norm = Norm(c.head_dim, "rmsnorm", c.norm_eps, **kw)
            self.k_norm = Norm(c.head_dim, "rmsnorm", c.norm_eps, **kw)

    def _core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_len: int,
        documents: DocumentMask | None = None,
    ) -> torch.Tensor:
        # [s, b, n, d] -> [b, n, s, d] for SDPA
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if self.cp > 1:
            out = context_parallel_attention(
                q, k, v, cp_group=self.cp_group, seq_len=seq_len, method=self.cp_method,
                documents=documents,
            )  # fmt: skip
        elif documents is not None:  # packed documents (attention dropout refused with them)
            out = document_attention(q, k, v, documents)
        else:
            p = self.dropout if self.training else 0.0
            with dropout_rng(self.rng, p):
                out = F.scaled_dot_product_attention(
                    q, k, v, dropout_p=p, is_causal=True, enable_gqa=self.heads != self.kv_heads
                )
        return out.permute(2, 0, 1, 3)  # [b, n, s, d] -> [s, b, n, d]

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        seq_len: int,
        documents: DocumentMask | None = None,
    ) -> torch.Tensor:
        """``documents``: keep each token's attention inside its packed document."""
        qkv = self.qkv(x)  # [s(/tp), b, h] -> [s, b, (n + 2 kv) d / tp]
        s, b = qkv.shape[0], qkv.shape[1]
        per_group = self.heads // self.kv_heads
        qkv = qkv.view(s, b, self.kv_heads, per_group + 2, self.head_dim)
        # split, not indexing: its backward is one concatenation, where slices' and selects'
        # backwards would each fill a zero tensor of qkv's size and then be added
        q, k, v = qkv.split([per_group, 1, 1], dim=3)
        q = q.reshape(s, b, self.heads, self.head_dim)
        k, v = k.squeeze(3), v.squeeze(3)  # [s, b, kv/tp, d]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = run_fused(self.fused, rope_qk, q, k, *rope)
        recompute = self.recompute_core and self.training
        core = functools.partial(self._core, documents=documents)
        out = run_core(core, q, k, v, seq_len, recompute, self.rng, self.dropout)
        out = out.reshape(s, b, self.heads * self.head_dim)
        result: torch.Tensor = self.proj(out)  # [s, b, n d / tp] -> [s(/tp), b, h]
        return result
