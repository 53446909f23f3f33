"""The progress line of ``preprocess``: files, shards, documents, tokens and tokens/s on stderr.

On a terminal the line is redrawn in place at most ten times a second; in a log (not a tty) a
full line is written at most every ``log_interval`` seconds (30 by default), so a long job
leaves a few hundred lines, not millions.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressLine"]


class ProgressLine:
    """Counts what the workers report and shows it, throttled; :meth:`close` ends the line."""

    def __init__(
        self,
        total_files: int,
        total_shards: int,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        log_interval: float = 30.0,
    ) -> None:
        self.total_files, self.total_shards = total_files, total_shards
        self.files = self.shards = self.documents = self.tokens = 0
        self.enabled = enabled
        self._stream = stream if stream is not None else sys.stderr
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._interval = 0.1 if self._tty else log_interval
        self._started = self._shown = time.perf_counter()
        self._drawn = False

    def text(self) -> str:
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        return (
            f"preprocess: {self.files:,}/{self.total_files:,} files, "
            f"{self.shards:,}/{self.total_shards:,} shards, {self.documents:,} documents, "
            f"{self.tokens:,} tokens, {self.tokens / elapsed:,.0f} tokens/s"
        )

    def advance(
        self, *, documents: int = 0, tokens: int = 0, shards: int = 0, files: int = 0
    ) -> None:
        self.documents += documents
        self.tokens += tokens
        self.shards += shards
        self.files += files
        now = time.perf_counter()
        if self.enabled and now - self._shown >= self._interval:
            self._shown = now
            self._draw()

    def _draw(self) -> None:
        if self._tty:
            self._stream.write("\r" + self.text() + "\x1b[K")
        else:
            self._stream.write(self.text() + "\n")
        self._stream.flush()
        self._drawn = True

    def close(self) -> None:
        """On a terminal, draw the final counts and end the line; in a log, write nothing more
        (the caller prints the summary)."""
        if self.enabled and self._tty:
            self._draw()
            self._stream.write("\n")
            self._stream.flush()
