"""Activation recomputation that replays the tracked (per-tp-rank) RNG states."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from mega_tp_layers import RNGStatesTracker

__all__ = ["rng_checkpoint_contexts"]


def rng_checkpoint_contexts(
    tracker: RNGStatesTracker | None,
) -> Callable[[], tuple[AbstractContextManager[None], AbstractContextManager[None]]]:
    """``context_fn`` for ``torch.utils.checkpoint``: replay the tracked RNG on recompute.

    Checkpointing restores the default generators itself; the tracked (per-tp-rank)
    states are ours: the recompute starts from the states the forward started from, and
    the states after it are put back, so dropout masks are the same both times.
    """

    def contexts() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        if tracker is None:
            return nullcontext(), nullcontext()
        saved: dict[str, torch.Tensor] = {}

        @contextmanager
        def forward() -> Iterator[None]:
            saved.update(tracker.state_dict())
            yield

        @contextmanager
        def recompute() -> Iterator[None]:
            after = tracker.state_dict()
            tracker.load_state_dict(saved)
            try:
                yield
            finally:
                tracker.load_state_dict(after)

        return forward(), recompute()

    return contexts
