"""Document-aware packing: documents found from the EOD token, attention kept inside them.

A packed sample concatenates documents, each ended by the EOD id. Megatron's three switches
(``reset_position_ids``, ``reset_attention_mask``, ``eod_mask_loss``) are
:class:`DocumentPacking`. The document of each token is derived from the token ids alone
(:func:`document_ids`: an EOD belongs to the document it ends), on the whole sequence before
the context-parallel split, so that every cp rank and pipeline stage sees the same layout.

Attention: a query attends to the keys of its own document at earlier or equal positions.
:func:`document_mask` describes that for this rank's queries (its zig-zag share under cp)
against the keys the core sees (all of them, in the all-gathered order, under cp);
:func:`document_attention` runs it through FlexAttention with a block mask on CUDA (no
``[s, s]`` matrix: whole blocks outside a document are skipped) or through SDPA with a
boolean ``[b, 1, s_q, s_k]`` mask elsewhere (the CPU path the tests take).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from mega_models.context_parallel import zigzag_positions

__all__ = [
    "DocumentMask",
    "DocumentPacking",
    "Documents",
    "document_attention",
    "document_ids",
    "document_mask",
    "document_positions",
    "loss_mask",
]

Backend = Literal["auto", "flex", "sdpa"]


@dataclass(frozen=True)
class DocumentPacking:
    """How packed samples are read (Megatron's switches of the same names)."""

    eod_id: int
    """The token id that ends each document."""
    reset_position_ids: bool = False
    """Positions restart at 0 after each EOD (rope rotates by the position in the document)."""
    reset_attention_mask: bool = False
    """A token attends only to earlier tokens of its own document."""
    eod_mask_loss: bool = False
    """The prediction made at an EOD (whose target is the next document's first token) is
    left out of the loss, which is the mean over the remaining positions."""

    @property
    def needs_documents(self) -> bool:
        """Whether the model must be given the documents (positions or mask)."""
        return self.reset_position_ids or self.reset_attention_mask

    def documents(self, tokens: Tensor) -> Documents:
        """The documents of ``tokens`` ``[b, s]`` as these switches ask for them."""
        ids = document_ids(tokens, self.eod_id)
        return Documents(
            ids=ids if self.reset_attention_mask else None,
            positions=document_positions(ids) if self.reset_position_ids else None,
        )


@dataclass(frozen=True)
class Documents:
    """One micro-batch's packing over its whole sequence (before the cp split)."""

    ids: Tensor | None
    """``[b, s]`` document index of each token (None: attention crosses documents)."""
    positions: Tensor | None
    """``[b, s]`` position of each token inside its document (None: absolute positions)."""


def document_ids(tokens: Tensor, eod_id: int) -> Tensor:
    """``[b, s]`` ids -> ``[b, s]`` index of each token's document in its sample (0, 1, ...);
    an EOD belongs to the document it ends."""
    is_eod = (tokens == eod_id).to(torch.int64)
    return torch.cumsum(is_eod, dim=-1) - is_eod  # EODs strictly before each token


def document_positions(ids: Tensor) -> Tensor:
    """``[b, s]`` document ids -> ``[b, s]`` positions, 0 at each document's first token."""
    s = ids.shape[-1]
    index = torch.arange(s, device=ids.device).expand_as(ids)
    start = torch.ones_like(ids, dtype=torch.bool)
    start[..., 1:] = ids[..., 1:] != ids[..., :-1]
    first = torch.cummax(torch.where(start, index, torch.zeros_like(index)), dim=-1).values
    return index - first


def loss_mask(tokens: Tensor, eod_id: int) -> Tensor:
    """``[b, s]`` ids -> ``[b, s]`` bool: True where the prediction counts (the input is not
    an EOD; Megatron's ``eod_mask_loss``)."""
    return tokens != eod_id


@dataclass(frozen=True)
class DocumentMask:
    """Which keys each of this rank's queries may see: same document, not later."""

    q_ids: Tensor
    """``[b, s_q]`` documents of the queries."""
    k_ids: Tensor
    """``[b, s_k]`` documents of the keys, in the order the core sees them."""
    q_pos: Tensor
    """``[s_q]`` positions of the queries in the sequence."""
    k_pos: Tensor
    """``[s_k]`` positions of the keys."""
    block_mask: Any = None
    """FlexAttention's ``BlockMask`` of the same mask (the CUDA path), or None (SDPA)."""

    def dense(self) -> Tensor:
        """The mask as SDPA takes it, ``[b, 1, s_q, s_k]`` bool (True: attend)."""
        same = self.q_ids[:, :, None] == self.k_ids[:, None, :]
        causal = self.q_pos[:, None] >= self.k_pos[None, :]
        return (same & causal).unsqueeze(1)


def document_mask(
    ids: Tensor, *, cp: int = 1, cp_rank: int = 0, backend: Backend = "auto"
) -> DocumentMask:
    """The mask for cp rank ``cp_rank``'s queries given the whole sequence's document ids
    ``[b, s]``; under cp the keys are in the all-gathered order (rank 0's zig-zag share,
    then rank 1's, ...). ``backend`` "auto" builds FlexAttention's block mask on CUDA."""
    s = ids.shape[1]
    if cp == 1:
        q_pos = k_pos = torch.arange(s, device=ids.device)
    else:
        q_pos = zigzag_positions(s, cp, cp_rank, device=ids.device)
        k_pos = torch.cat([zigzag_positions(s, cp, r, device=ids.device) for r in range(cp)])
    q_ids, k_ids = ids.index_select(1, q_pos), ids.index_select(1, k_pos)
    flex = backend == "flex" or (backend == "auto" and ids.is_cuda)
    block = _block_mask(q_ids, k_ids, q_pos, k_pos) if flex else None
    return DocumentMask(q_ids, k_ids, q_pos, k_pos, block)


def _block_mask(q_ids: Tensor, k_ids: Tensor, q_pos: Tensor, k_pos: Tensor) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (q_ids[b, q] == k_ids[b, kv]) & (q_pos[q] >= k_pos[kv])

    b, sq = q_ids.shape
    return create_block_mask(mask_mod, b, None, sq, k_ids.shape[1], device=q_ids.device)


#: FlexAttention's CUDA kernels need a head (query/key and value) dim of at least this;
#: narrower heads (the tests' tiny models) take SDPA with the dense mask there.
FLEX_MIN_HEAD_DIM = 16


@functools.cache
def _flex() -> Callable[..., Tensor]:
    """FlexAttention, compiled once (eager FlexAttention materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled: Callable[..., Tensor] = torch.compile(flex_attention, dynamic=False)
    return compiled


def document_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask, *, scale: float | None = None
) -> Tensor:
    """``[b, n, s_q, d] x [b, n_kv, s_k, d] x [b, n_kv, s_k, d_v] -> [b, n, s_q, d_v]``
    attention under ``mask`` (GQA: n_kv divides n; MLA: ``d_v < d``, padded to ``d`` for
    FlexAttention and cut back)."""
    gqa = q.shape[1] != k.shape[1]
    narrow = q.is_cuda and min(q.shape[-1], v.shape[-1]) < FLEX_MIN_HEAD_DIM
    if mask.block_mask is not None and not narrow:
        from torch.nn.attention.flex_attention import flex_attention

        flex: Callable[..., Tensor] = flex_attention  # eager on CPU: the reference
        if q.is_cuda and not torch.compiler.is_compiling():  # a compiled layer compiles it
            flex = _flex()
        dv = v.shape[-1]
        v = F.pad(v, (0, q.shape[-1] - dv)) if dv < q.shape[-1] else v
        out = flex(q, k, v, block_mask=mask.block_mask, scale=scale, enable_gqa=gqa)
        assert isinstance(out, Tensor)
        return out[..., :dv]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.dense(), scale=scale, enable_gqa=gqa
    )
