"""Helpers shared by the tp-layers tests: recording torch.distributed calls, collecting errors."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist


@contextmanager
def recorded_dist_calls(
    names: Sequence[str], entry: Callable[[str, dict[str, Any]], Any]
) -> Iterator[list[Any]]:
    """Record ``entry(name, kwargs)`` for every ``torch.distributed.<name>`` call inside."""
    calls: list[Any] = []
    originals = {name: getattr(dist, name) for name in names}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(entry(name, kwargs))
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def error_messages(cases: dict[str, Callable[[], object]]) -> dict[str, str]:
    """Each case's ValueError message, or "no error raised"."""
    out: dict[str, str] = {}
    for key, build in cases.items():
        try:
            build()
            out[key] = "no error raised"
        except ValueError as exc:
            out[key] = str(exc)
    return out
