"""Marking forward passes that recompute one already run (activation checkpointing).

A router with an aux-loss-free expert bias counts the tokens it sends to each expert in
forward. When a layer is recomputed in backward, the same tokens are routed again; those
must not be counted twice. Wrap the recomputation in :func:`recomputing` (mega-models does
for full recompute). The flag is a module-level value, so ``torch.compile`` guards on it
and keeps one graph for each state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["is_recomputing", "recomputing"]

_recomputing = False


@contextmanager
def recomputing() -> Iterator[None]:
    """Forward passes inside recompute a forward that already ran (and counted its load)."""
    global _recomputing
    before = _recomputing
    _recomputing = True
    try:
        yield
    finally:
        _recomputing = before


def is_recomputing() -> bool:
    """Whether the current forward pass is a recomputation (see :func:`recomputing`)."""
    return _recomputing
