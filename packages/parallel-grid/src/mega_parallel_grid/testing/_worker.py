"""The loop each pooled worker process runs: one torch.distributed world per call."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import random
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]


def resolve(module: str, file: str | None, qualname: str) -> Any:
    """Find ``module.qualname`` in this process, loading the module from ``file`` if needed.

    Test modules collected by pytest's importlib mode are not importable by name, so the
    parent sends their file path too.
    """
    mod: ModuleType | None = sys.modules.get(module)
    if mod is None:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            if file is None:
                raise
            spec = importlib.util.spec_from_file_location(module, file)
            if spec is None or spec.loader is None:
                raise
            mod = importlib.util.module_from_spec(spec)
            sys.modules[module] = mod
            spec.loader.exec_module(mod)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def worker_main(
    rank: int,
    world_size: int,
    store_host: str,
    store_port: int,
    backend: str,
    conn: Connection,
    collective_timeout_s: float,
) -> None:
    """Serve calls until told to stop; each call starts with only the default group."""
    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = TCPStore(store_host, store_port, is_master=False, timeout=timedelta(seconds=60))
    # One default group for the worker's life (building one per call costs ~10 ms per
    # rank); groups a call creates are destroyed after it, so each call starts clean.
    # Under NCCL, gloo serves CPU tensors too, so a test can mix both devices.
    pg_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
    dist.init_process_group(
        pg_backend, store=store, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=collective_timeout_s),
    )  # fmt: skip
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            return
        header, payload = pickle.loads(message)
        if header == "stop":
            dist.destroy_process_group()
            return
        call_id, module, file, qualname, seed = header
        try:
            fn = resolve(module, file, qualname)
            args, kwargs = pickle.loads(payload)
            try:
                _seed_all(seed)
                result = fn(*args, **kwargs)
            finally:
                _destroy_subgroups()
            conn.send_bytes(pickle.dumps(("ok", call_id, result)))
        except BaseException as exc:  # report everything, including KeyboardInterrupt
            text = "".join(traceback.format_exception(exc))
            try:
                conn.send_bytes(pickle.dumps(("err", call_id, (type(exc).__name__, text))))
            except (BrokenPipeError, OSError):
                return


def _destroy_subgroups() -> None:
    """Destroy every process group but the default one."""
    from torch.distributed import distributed_c10d as c10d

    world = dist.group.WORLD
    for group in list(c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)
