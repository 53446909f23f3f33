"""Shards written by N worker processes (``spawn``: no inherited threads or locks), each taking
the next shard from a queue and sending back its progress, its result or its error.

The tokenizer travels to each worker once, pickled (every built-in tokenizer pickles). A
worker's bad-input error comes back as the same one-sentence :class:`DataError`; a worker that
dies (killed, out of memory) stops the run with a sentence naming its exit code, and the shards
already complete stay on disk for the next run to keep.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from mega_pretrain.data.errors import DataError
from mega_pretrain.data.shards import ShardJob, ShardResult, write_shard
from mega_pretrain.data.sources import Piece

__all__ = ["ShardTask", "run_shards"]

#: (shard index, the pieces it covers)
ShardTask = tuple[int, Sequence[Piece]]
_REPORT_SECONDS = 0.5


class _Reporter:
    """Sums a shard's progress and sends it at most every half second."""

    def __init__(self, results: Any, index: int) -> None:
        self.results, self.index = results, index
        self.documents = self.tokens = 0
        self.last = time.perf_counter()

    def __call__(self, documents: int, tokens: int) -> None:
        self.documents += documents
        self.tokens += tokens
        if time.perf_counter() - self.last >= _REPORT_SECONDS:
            self.flush()

    def flush(self) -> None:
        self.results.put(("progress", self.index, self.documents, self.tokens))
        self.documents = self.tokens = 0
        self.last = time.perf_counter()


def _worker(job: ShardJob, tasks: Any, results: Any) -> None:
    """Write shards until the queue hands out None (quietly stopped by Ctrl-C, which the
    parent sees too)."""
    try:
        _work(job, tasks, results)
    except KeyboardInterrupt:
        pass


def _work(job: ShardJob, tasks: Any, results: Any) -> None:
    while (task := tasks.get()) is not None:
        index, pieces = task
        report = _Reporter(results, index)
        try:
            result = write_shard(job, index, pieces, report)
        except BaseException as exc:
            results.put(("error", index, _portable(exc), traceback.format_exc()))
            return
        report.flush()
        results.put(("done", index, result))


def _portable(exc: BaseException) -> BaseException:
    if isinstance(exc, DataError | ImportError):
        return type(exc)(str(exc))
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _check_picklable(job: ShardJob) -> None:
    try:
        pickle.dumps(job.tokenizer)
    except Exception as exc:
        raise ValueError(
            f"tokenizer {job.tokenizer!r} cannot be pickled for worker processes "
            f"({type(exc).__name__}: {exc}); use workers=1 or a tokenizer that pickles"
        ) from None


def run_shards(
    job: ShardJob,
    tasks: Sequence[ShardTask],
    workers: int,
    on_progress: Callable[[int, int], None],
    on_done: Callable[[int, ShardResult], None],
) -> None:
    """Write every shard of ``tasks``: in this process when ``workers`` is 1 (or one shard is
    left), else in ``workers`` spawned processes. Calls ``on_progress(documents, tokens)``
    and ``on_done(index, result)`` in this process, as the shards advance."""
    if workers <= 1 or len(tasks) <= 1:
        for index, pieces in tasks:
            on_done(index, write_shard(job, index, pieces, on_progress))
        return
    _check_picklable(job)
    ctx = mp.get_context("spawn")
    todo: Any = ctx.Queue()
    results: Any = ctx.Queue()
    count = min(workers, len(tasks))
    for task in tasks:
        todo.put(task)
    for _ in range(count):
        todo.put(None)
    procs = [
        ctx.Process(target=_worker, args=(job, todo, results), name=f"preprocess-{i}", daemon=True)
        for i in range(count)
    ]
    for proc in procs:
        proc.start()
    try:
        remaining = len(tasks)
        while remaining:
            try:
                message = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or all(p.exitcode == 0 for p in procs):
                    code = dead[0].exitcode if dead else 0
                    raise RuntimeError(
                        f"preprocess worker {(dead or procs)[0].name} exited (code {code}) with "
                        f"{remaining} shards unwritten (its traceback, if it printed one, is "
                        "above); run the same command again to resume from the complete "
                        f"shards in {job.folder}"
                    ) from None
                continue
            if message[0] == "progress":
                on_progress(message[2], message[3])
            elif message[0] == "done":
                remaining -= 1
                on_done(message[1], message[2])
            else:
                exc, where = message[2], message[3]
                if isinstance(exc, DataError | ImportError):
                    raise exc
                raise RuntimeError(
                    f"preprocess worker failed on shard {message[1]}: {exc}\n{where}"
                ) from exc
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=10)
        todo.cancel_join_thread()
        todo.close()
        results.close()
