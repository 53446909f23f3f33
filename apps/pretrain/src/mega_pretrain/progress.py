"""A live progress bar on an interactive terminal (rank 0), nothing elsewhere."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

__all__ = ["LiveProgress"]


class LiveProgress:
    """Step counter with the last logged loss, lr and tokens/s, and the ETA.

    Only drawn when ``console`` is an interactive terminal; log lines still go through
    ``console`` (printed above the bar), so files and CI logs look the same either way.
    """

    def __init__(self, console: Console, total: int, start: int) -> None:
        self._progress: Progress | None = None
        if console.is_terminal and not console.quiet:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                console=console, transient=True,
            )  # fmt: skip
            self._task = self._progress.add_task("train", total=total, completed=start, status="")

    def __enter__(self) -> LiveProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def advance(self, step: int, status: str | None = None) -> None:
        if self._progress is None:
            return
        if status is None:
            self._progress.update(self._task, completed=step)
        else:
            self._progress.update(self._task, completed=step, status=status)
