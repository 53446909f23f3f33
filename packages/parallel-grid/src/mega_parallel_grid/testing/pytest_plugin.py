"""pytest plugin: the session-scoped ``dist_pool`` fixture (works under pytest-xdist)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mega_parallel_grid.testing.pool import DistPool

__all__ = ["dist_pool"]


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[DistPool]:
    """A :class:`DistPool` shared by the whole test session (one per xdist worker)."""
    with DistPool() as pool:
        yield pool
