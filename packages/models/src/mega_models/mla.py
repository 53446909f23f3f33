"""Multi-head latent attention (DeepSeek-V2/V3) with heads split over tp and context parallel.

Per token ``x [h]``: the query is ``W_qb norm(W_qa x)`` (or ``W_q x`` without q_lora_rank),
``n`` heads of ``qk_nope + qk_rope``; the key/value latent is ``W_kva x = [c_kv, k_rope]``
(``kv_lora_rank + qk_rope``), ``W_kvb norm(c_kv)`` gives each head its ``qk_nope`` key and
``v_head_dim`` value, and the one ``k_rope`` is every head's rope key. Rope turns
``q_rope`` and ``k_rope`` (rotate-half layout, :mod:`mega_models.rope`: a DeepSeek
checkpoint's interleaved rope rows of ``q_b_proj`` per head and of ``kv_a_proj_with_mqa``
are permuted evens-then-odds on import). Scores scale by ``config.softmax_scale``.

Weights: ``q_down`` (``q_a_proj``), ``q_norm``, ``q_up`` (``q_b_proj``, rows per head
``[nope, rope]``), ``kv_down`` (``kv_a_proj_with_mqa``, rows ``[c_kv, k_rope]``),
``kv_norm``, ``kv_up`` (``kv_b_proj``, rows per head ``[k_nope, v]``), ``proj``
(``o_proj``). Under tp the up-projections are column-parallel (each rank its heads), the
output projection row-parallel, the down-projections and latent norms replicated.

Sequence parallel: the down-projections and latent norms run on this rank's sequence
shard and the narrow latents are all-gathered afterwards (inside the up-projections, and
``k_rope`` on its own): the latents (``q_lora + kv_lora + qk_rope``, 1,344 for DeepSeek-V3)
are narrower than the hidden state (7,168), so this moves less than gathering ``x`` first
and computes each down-projection once per token instead of tp times. Their weight
gradients are then partial per rank and marked like the norms' (``partial_grads``), for
``finalize_model_grads`` to sum over tp.

Core attention: ``F.scaled_dot_product_attention`` with the qk head dim
(``qk_nope + qk_rope``) larger than the value head dim. On CPU its math kernel takes that
as is in eager mode. On CUDA in half precision without dropout, where cuDNN's fused
attention takes a narrower value head (sm90 or newer, cuDNN 9.10 or newer), that kernel
runs on the unequal dims: on an H100 at ``deepseek-v3-3b``'s shape (qk 192, v 128, 16
heads, 4 x 2048 tokens) it took 1.12 ms forward and backward where cuDNN on values padded
to 192 took 1.54, and the whole compiled step ran 1.04x faster (bench/RESULTS.md,
2026-12-07).
Elsewhere on CUDA in half precision, and under ``torch.compile`` on any device, the values
are zero-padded to the qk dim and the output sliced back: the flash kernel needs equal
dims, and Inductor's attention pattern matcher fails (logging a traceback) on unequal
ones. In eager fp32 on CUDA SDPA picks the efficient or math kernel, which take unequal
dims. The result is the same attention everywhere. Context parallel (ring or all-gather)
takes unequal dims directly.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mega_models.attention import AttentionBase, dropout_rng, run_core
from mega_models.config import GPTConfig
from mega_models.context_parallel import context_parallel_attention
from mega_models.doc_mask import DocumentMask, document_attention
from mega_models.fused_ops import rope_qk, run_fused
from mega_models.norms import Norm
from mega_models.replicated_linear import ReplicatedLinear
from mega_tp_layers import (
    ColumnParallelLinear,
    Normal,
    RowParallelLinear,
    ScaledNormal,
    copy_to_tp_region,
    gather_from_sequence_region,
)

__all__ = ["MultiLatentAttention", "cudnn_takes_narrow_values", "latent_sdpa"]


#: cuDNN 9.10 or newer: its fused attention takes a value head narrower than the query's
#: on sm90+. Read once at import (no device touched): under torch.compile the version query
#: cannot be traced, and a decorator that could mark it constant imports dynamo
_CUDNN_NARROW_VALUES = (torch.backends.cudnn.version() or 0) >= 91000  # type: ignore[no-untyped-call]


def cudnn_takes_narrow_values(device: torch.device) -> bool:
    """Whether cuDNN's fused attention runs on ``device`` with a value head narrower than the
    query's (MLA's shape): a CUDA device of compute capability 9.0 or newer and cuDNN 9.10
    or newer (torch's cuDNN backend is then used for that call whatever the SDPA order)."""
    if device.type != "cuda" or not _CUDNN_NARROW_VALUES:
        return False
    props = torch.cuda.get_device_properties(device)  # a constant to torch.compile
    return (props.major, props.minor) >= (9, 0)


def latent_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, dropout_p: float = 0.0
) -> torch.Tensor:
    """Causal SDPA ``[b, n, s, d_qk] x [b, n, s, d_v] -> [b, n, s, d_v]`` for ``d_v <= d_qk``:
    on CUDA in half precision cuDNN's kernel on the unequal dims where it takes them (see
    :func:`cudnn_takes_narrow_values`), else there and under compile ``v`` zero-padded to
    ``d_qk``."""
    dv = v.shape[-1]
    half = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if dv < q.shape[-1] and half and dropout_p == 0.0 and cudnn_takes_narrow_values(q.device):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    pad = dv < q.shape[-1] and (half or torch.compiler.is_compiling())
    if pad:
        v = F.pad(v, (0, q.shape[-1] - dv))
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
    return out[..., :dv] if pad else out


class MultiLatentAttention(AttentionBase):
    """``[s(/tp), b, h] -> [s(/tp), b, h]``: :class:`~mega_models.attention.SelfAttention`'s
    calling convention, ``forward(x, rope, seq_len)`` with rope tables ``qk_rope`` wide."""

    def _build(self, config: GPTConfig, linear: dict[str, Any]) -> None:
        c = config
        assert c.attention == "mla" and c.kv_lora_rank and c.qk_nope_head_dim
        assert c.qk_rope_head_dim and c.v_head_dim
        n, h = c.num_attention_heads, c.hidden_size
        self.nope, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora = c.kv_lora_rank
        self.scale = c.softmax_scale
        col: dict[str, Any] = {**linear, "bias": False, "init_method": Normal(c.init_std)}
        rep: dict[str, Any] = {
            k: v for k, v in col.items() if k not in ("bias", "tp_comm_overlap", "wgrad_fusion")
        }
        norm: dict[str, Any] = {"tp_group": self.tp_group, "partial_grads": self.sequence_parallel,
                                "device": linear["device"], "dtype": linear["dtype"]}  # fmt: skip
        qk = self.nope + self.rope_dim
        self.q_down: ReplicatedLinear | None = None
        self.q_norm: Norm | None = None
        if c.q_lora_rank is None:
            # [s(/tp), b, h] -> [s, b, n qk / tp]
            self.q_up = ColumnParallelLinear(h, n * qk, **col)
        else:
            self.q_down = ReplicatedLinear(h, c.q_lora_rank, **rep)
            self.q_norm = Norm(c.q_lora_rank, "rmsnorm", c.norm_eps, **norm)
            self.q_up = ColumnParallelLinear(c.q_lora_rank, n * qk, **col)
        self.kv_down = ReplicatedLinear(h, self.kv_lora + self.rope_dim, **rep)
        self.kv_norm = Norm(self.kv_lora, "rmsnorm", c.norm_eps, **norm)
        self.kv_up = ColumnParallelLinear(self.kv_lora, n * (self.nope + self.v_dim), **col)
        self.proj = RowParallelLinear(
            n * self.v_dim, h, **{**col, "init_method": ScaledNormal(c.init_std, c.num_layers)}
        )

    def _shared_rope_key(self, k_rope: torch.Tensor) -> torch.Tensor:
        """The one rope key, whole-sequence on every rank: under SP gathered (its gradient
        reduce-scattered), else its gradient summed over the ranks' heads."""
        if self.tp == 1:
            return k_rope
        if self.sequence_parallel:
            return gather_from_sequence_region(k_rope, self.tp_group)  # [s/tp, b, r] -> [s, b, r]
        return copy_to_tp_region(k_rope, self.tp_group)

    def _core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_len: int,
        documents: DocumentMask | None = None,
    ) -> torch.Tensor:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [s, b, n, d] -> [b, n, s, d]
        if self.cp > 1:
            out = context_parallel_attention(
                q, k, v, cp_group=self.cp_group, seq_len=seq_len, method=self.cp_method,
                scale=self.scale, documents=documents,
            )  # fmt: skip
        elif documents is not None:  # packed documents (attention dropout refused with them)
            out = document_attention(q, k, v, documents, scale=self.scale)
        else:
            p = self.dropout if self.training else 0.0
            with dropout_rng(self.rng, p):
                out = latent_sdpa(q, k, v, scale=self.scale, dropout_p=p)
        return out.permute(2, 0, 1, 3)  # [b, n, s, d_v] -> [s, b, n, d_v]

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        seq_len: int,
        documents: DocumentMask | None = None,
    ) -> torch.Tensor:
        assert rope is not None, "MLA needs rope tables (config.position is 'rope')"
        if self.q_down is not None and self.q_norm is not None:
            q = self.q_up(self.q_norm(self.q_down(x)))  # [s(/tp), b, h] -> [s, b, n qk / tp]
        else:
            q = self.q_up(x)
        s, b = q.shape[0], q.shape[1]
        q = q.view(s, b, self.heads, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent = self.kv_down(x)  # [s(/tp), b, h] -> [s(/tp), b, kv_lora + r]
        c_kv, k_rope = latent.split([self.kv_lora, self.rope_dim], dim=-1)
        kv = self.kv_up(self.kv_norm(c_kv))  # -> [s, b, n (nope + v) / tp]
        k_nope, v = kv.view(s, b, self.heads, self.nope + self.v_dim).split(
            [self.nope, self.v_dim], dim=-1
        )
        k_rope = self._shared_rope_key(k_rope).unsqueeze(2)  # [s, b, 1, r]
        q_rope, k_rope = run_fused(self.fused, rope_qk, q_rope, k_rope, *rope)
        q = torch.cat([q_nope, q_rope], dim=-1)  # [s, b, n/tp, nope + r]
        k = torch.cat([k_nope, k_rope.expand(s, b, self.heads, self.rope_dim)], dim=-1)
        recompute = self.recompute_core and self.training
        core = functools.partial(self._core, documents=documents)
        out = run_core(core, q, k, v, seq_len, recompute, self.rng, self.dropout)
        out = out.reshape(s, b, self.heads * self.v_dim)
        result: torch.Tensor = self.proj(out)  # [s, b, n v / tp] -> [s(/tp), b, h]
        return result
