"""The single-process reference of a layout contract, computed once per test process.

Every layout case of a contract compares with the plain single-process run of the same
model settings, and many cases share those settings: the reference depends on nothing
else (its seed, data and steps are the contract's constants), so each test process runs
it once per settings and keeps the result (read-only: the checks only compare with it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mega_parallel_grid.testing import DistPool

__all__ = ["reference_once"]

_KEPT: dict[str, Any] = {}


def reference_once(dist_pool: DistPool, fn: Callable[..., Any], *args: Any) -> Any:
    """``dist_pool.run(fn, 1, args=args)[0]``, run once per ``fn`` and ``args`` here."""
    key = json.dumps([fn.__module__, fn.__qualname__, args], sort_keys=True, default=repr)
    if key not in _KEPT:
        _KEPT[key] = dist_pool.run(fn, 1, args=args)[0]
    return _KEPT[key]
