"""A pipeline stage's layers and, on the last stage, its head: shared by GPT and hybrid models."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from mega_models.config import GPTConfig
from mega_models.doc_mask import DocumentMask
from mega_models.head import Embedding
from mega_models.overlap import overlap_boundary
from mega_models.rng_replay import rng_checkpoint_contexts
from mega_models.stages import StageSpec
from mega_tp_layers import ColumnParallelLinear, RNGStatesTracker

__all__ = ["StageModel", "run_layer", "run_stage"]


class StageModel(Protocol):
    """What :func:`run_stage` reads from a model chunk (GPTModel, HybridModel), read-only."""

    @property
    def config(self) -> GPTConfig:
        """The model's config."""

    @property
    def stage(self) -> StageSpec:
        """Which layers and ends this chunk holds."""

    @property
    def training(self) -> bool:
        """Train or eval mode."""

    @property
    def recompute(self) -> str:
        """'full' recomputes each layer in backward."""

    @property
    def rng(self) -> RNGStatesTracker | None:
        """The tracked RNG replayed on recompute."""

    @property
    def embedding(self) -> Embedding | None:
        """The embedding (or the last stage's tied copy), if held."""

    @property
    def final_norm(self) -> nn.Module | None:
        """The final norm (last stage)."""

    @property
    def output(self) -> ColumnParallelLinear | None:
        """The output layer (None when tied)."""

    @property
    def tp_group(self) -> ProcessGroup:
        """The tensor-parallel group."""

    @property
    def sequence_parallel(self) -> bool:
        """Whether activations are split along the sequence over tp."""

    @property
    def head_fn(self) -> Callable[..., Tensor]:
        """Norm, output layer and loss (possibly compiled)."""


def run_layer(
    model: StageModel,
    layer: nn.Module,
    hidden: Tensor,
    rope: tuple[Tensor, Tensor] | None,
    seq_len: int,
    documents: DocumentMask | None = None,
) -> Tensor:
    """One layer on ``hidden``, recomputed in backward with ``recompute="full"``;
    ``documents`` (packed documents) is passed on only when given."""
    args = (hidden, rope, seq_len) if documents is None else (hidden, rope, seq_len, documents)
    if model.recompute == "full" and model.training:
        out = checkpoint(
            layer, *args, use_reentrant=False, context_fn=rng_checkpoint_contexts(model.rng)
        )
    else:
        out = layer(*args)
    assert isinstance(out, Tensor)
    return out


def run_stage(
    model: StageModel,
    layers: Iterable[nn.Module],
    hidden: Tensor,
    labels: Tensor | None,
    rope: tuple[Tensor, Tensor] | None,
    seq_len: int,
    *,
    head: bool = True,
    documents: DocumentMask | None = None,
) -> Tensor:
    """``hidden`` through ``layers`` (recomputed in backward with ``recompute="full"``),
    then, on the last stage unless ``head`` is False, the final norm, output layer and
    loss (or logits)."""
    for layer in layers:
        if isinstance(model, nn.Module):  # a DualPipeV pair's backward piece; a recorded input
            hidden = overlap_boundary(model, hidden)
        hidden = run_layer(model, layer, hidden, rope, seq_len, documents)
    if not model.stage.last or not head:
        return hidden
    assert model.final_norm is not None
    return model.head_fn(
        hidden, labels, final_norm=model.final_norm, output=model.output,
        tied_weight=model.embedding.word.weight if model.embedding is not None else None,
        tp_group=model.tp_group, sequence_parallel=model.sequence_parallel,
        vocab_size=model.config.vocab_size,
    )  # fmt: skip
