"""Activation recomputation that replays the tracked (per-tp-rank) RNG states."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from mega_moe import recomputing
from mega_tp_layers import RNGStatesTracker

__all__ = ["rng_checkpoint_contexts"]


def rng_checkpoint_contexts(
    tracker: RNGStatesTracker | None,
) -> Callable[[], tuple[AbstractContextManager[None], AbstractContextManager[None]]]:
    """``context_fn`` for ``torch.utils.checkpoint``: replay the tracked RNG on recompute.

    Checkpointing restores the default generators itself; the tracked (per-tp-rank)
    states are ours: the recompute starts from the states the forward started from, and
    the states after it are put back, so dropout masks are the same both times. The
    recompute also runs under ``mega_moe.recomputing()``, so MoE routers do not count
    their expert load a second time.
    """

    def contexts() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        saved: dict[str, torch.Tensor] = {}

        @contextmanager
        def forward() -> Iterator[None]:
            if tracker is not None:
                saved.update(tracker.state_dict())
            yield

        @contextmanager
        def recompute() -> Iterator[None]:
            after = tracker.state_dict() if tracker is not None else None
            if tracker is not None:
                tracker.load_state_dict(saved)
            try:
                with recomputing():
                    yield
            finally:
                if tracker is not None and after is not None:
                    tracker.load_state_dict(after)

        return forward(), recompute()

    return contexts
