"""A pool of live worker processes per world size, for running parallel code in tests."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from mega_parallel_grid.testing._worker import worker_main

__all__ = ["DistPool", "RankFailedError", "RankTimeoutError"]

T = TypeVar("T")

_NCCL_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


class RankFailedError(AssertionError):
    """A rank raised (or died) while running a pooled call; the message holds its traceback."""


class RankTimeoutError(TimeoutError):
    """Some ranks did not finish a pooled call in time (a hang, or a peer that died)."""


#: A gloo error that says a peer socket closed while a group was being connected.
_TRANSIENT_CONNECT = "Gloo connectFullMesh failed"


@dataclass
class _Workers:
    world_size: int
    backend: str
    procs: list[BaseProcess]
    conns: list[Connection]
    store: TCPStore

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def stop(self, force: bool) -> None:
        if not force:
            for c in self.conns:
                try:
                    c.send_bytes(pickle.dumps(("stop", None)))
                except (BrokenPipeError, OSError):
                    force = True
        for p in self.procs:
            p.join(timeout=0 if force else 5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in self.conns:
            c.close()


def _default_backend(world_size: int) -> str:
    chosen = os.environ.get("MEGA_TEST_BACKEND")
    if chosen:
        return chosen
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


class DistPool:
    """Run a function on N ranks, reusing worker processes across calls.

    Workers for a world size start on first use and live until :meth:`close`. A call
    starts with only the default process group (groups an earlier call made are
    destroyed after it) and the same seed on every rank. The function must be defined at module level; its
    arguments and result travel by pickle. Use as a context manager or call ``close()``.

    >>> with DistPool() as pool:                                  # doctest: +SKIP
    ...     pool.run(all_reduce_check, world_size=4)
    """

    def __init__(
        self,
        backend: str | None = None,
        start_method: str = "forkserver",
        collective_timeout: float = 60.0,
    ) -> None:
        self._backend = backend
        self._collective_timeout = collective_timeout
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            self._ctx.set_forkserver_preload(["torch", "mega_parallel_grid.testing._worker"])
        self._workers: dict[int, _Workers] = {}
        self._calls = 0

    def __enter__(self) -> DistPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker process."""
        for workers in self._workers.values():
            workers.stop(force=False)
        self._workers.clear()

    def _start(self, world_size: int, backend: str) -> _Workers:
        for key, value in _NCCL_SAFE_ENV.items():
            os.environ.setdefault(key, value)
        store = TCPStore(
            "127.0.0.1", 0, world_size=None, is_master=True,
            timeout=timedelta(seconds=60), wait_for_workers=False,
        )  # fmt: skip
        procs: list[BaseProcess] = []
        conns: list[Connection] = []
        for rank in range(world_size):
            parent, child = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(  # type: ignore[attr-defined]
                target=worker_main,
                args=(
                    rank,
                    world_size,
                    "127.0.0.1",
                    store.port,
                    backend,
                    child,
                    self._collective_timeout,
                ),
                daemon=True,
                name=f"mega-rank{rank}-of-{world_size}",
            )
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        return _Workers(world_size, backend, procs, conns, store)

    def workers(self, world_size: int) -> _Workers:
        """The live workers of ``world_size`` ranks, started (or restarted) as needed."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size ({world_size!r}) must be a positive integer")
        backend = self._backend or _default_backend(world_size)
        if backend == "nccl" and torch.cuda.device_count() < world_size:
            raise ValueError(
                f"backend nccl needs one GPU per rank, but world_size is {world_size} and "
                f"{torch.cuda.device_count()} GPUs are visible; use backend='gloo'"
            )
        existing = self._workers.get(world_size)
        if existing is not None and (not existing.alive() or existing.backend != backend):
            existing.stop(force=True)
            existing = None
        if existing is None:
            existing = self._workers[world_size] = self._start(world_size, backend)
        return existing

    def run(
        self,
        fn: Callable[..., T],
        world_size: int,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        seed: int = 1234,
    ) -> list[T]:
        """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return each rank's result.

        Raises :class:`RankFailedError` with the failing rank's traceback if any rank
        raises or dies, and :class:`RankTimeoutError` naming the unfinished ranks if the
        call does not finish within ``timeout`` seconds; in both cases the workers of
        that world size are replaced, so the next call starts clean. The default timeout,
        a hang detector (it bounds no result), grows with the ranks sharing the machine's
        cores: ``max(120, 60 + 30 * world_size)`` s (8-rank calls ran past 120 s on a
        loaded 2-core machine, 2026-12-07).
        """
        if timeout is None:
            timeout = max(120.0, 60.0 + 30.0 * world_size)
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", "")
        if module is None or "<locals>" in qualname or "<lambda>" in qualname:
            raise ValueError(
                f"{qualname or fn!r} cannot be sent to worker processes; "
                "define the function at module level"
            )
        mod = sys.modules.get(module)
        file = getattr(mod, "__file__", None)
        payload = pickle.dumps((tuple(args), kwargs or {}))
        try:
            return self._call(world_size, (module, file, qualname, seed), payload, timeout)
        except RankFailedError as exc:
            if _TRANSIENT_CONNECT not in str(exc):
                raise
            # gloo lost a TCP connection while wiring up a group (port reuse under heavy
            # socket churn): an infrastructure fault, not the test's. The workers were
            # replaced; run the call once more on the fresh ones. A group that can never
            # connect fails the same way twice and is reported.
            warnings.warn(
                f"{qualname}: gloo lost a connection while connecting a group; retrying once",
                stacklevel=2,
            )
            return self._call(world_size, (module, file, qualname, seed), payload, timeout)

    def _call(
        self,
        world_size: int,
        where: tuple[str, str | None, str, int],
        payload: bytes,
        timeout: float,
    ) -> list[Any]:
        workers = self.workers(world_size)
        self._calls += 1
        call_id = self._calls
        module, file, qualname, seed = where
        header = (call_id, module, file, qualname, seed)
        message = pickle.dumps((header, payload))
        for conn in workers.conns:
            conn.send_bytes(message)
        return self._collect(workers, call_id, qualname, timeout)

    def _collect(self, workers: _Workers, call_id: int, name: str, timeout: float) -> list[Any]:
        n = workers.world_size
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        died: set[int] = set()  # a dead rank is the cause; its peers' errors are symptoms
        by_conn = {id(c): r for r, c in enumerate(workers.conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(workers.procs)}
        deadline = time.monotonic() + timeout
        pending = set(range(n))
        while pending:
            remaining = deadline - time.monotonic()
            if failures:
                remaining = min(remaining, 0.5)  # others are likely blocked on the failed rank
            if remaining <= 0:
                break
            waitables: list[Any] = [workers.conns[r] for r in pending]
            waitables += [workers.procs[r].sentinel for r in pending]
            ready = wait(waitables, timeout=remaining)
            if not ready:
                break
            for obj in ready:
                if isinstance(obj, int):
                    rank = by_sentinel[obj]
                    if rank in pending and not workers.conns[rank].poll():
                        code = workers.procs[rank].exitcode
                        failures[rank] = f"rank {rank} died with exit code {code}"
                        died.add(rank)
                        pending.discard(rank)
                    continue
                rank = by_conn[id(obj)]
                if rank not in pending:
                    continue
                assert isinstance(obj, Connection)
                try:
                    status, cid, value = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError):
                    failures[rank] = f"rank {rank} closed its pipe (process died)"
                    died.add(rank)
                    pending.discard(rank)
                    continue
                assert cid == call_id, f"stale reply {cid} for call {call_id}"
                pending.discard(rank)
                if status == "ok":
                    results[rank] = value
                else:
                    failures[rank] = value[1]
        if failures or pending:
            workers.stop(force=True)
            del self._workers[n]
        if failures:
            first = min(died) if died else min(failures)
            others = sorted(set(failures) - {first})
            extra = f" (ranks {others} failed too)" if others else ""
            raise RankFailedError(
                f"rank {first} of {n} failed in {name}{extra}:\n{failures[first]}"
            )
        if pending:
            raise RankTimeoutError(
                f"{name} on {n} ranks did not finish within {timeout:.0f} s; ranks "
                f"{sorted(pending)} never returned (a hang, or a collective missing on some rank)"
            )
        return [results[r] for r in range(n)]
