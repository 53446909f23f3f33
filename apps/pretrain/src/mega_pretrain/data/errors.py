"""The one exception type for bad data input: a missing file, a bad line, a corrupt index."""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """Bad data input, told in one sentence that names the file (and line) and the way out.

    A subclass of :class:`ValueError`, so a command line can catch it and print the message
    without a traceback.
    """
