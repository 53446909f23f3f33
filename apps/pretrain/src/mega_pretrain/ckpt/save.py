"""save_checkpoint: every rank writes its tensors in parallel, rank 0 commits the folder.

The folder is written as ``step_<step>.tmp`` and renamed to ``step_<step>`` only after
every rank finished, then ``latest`` is replaced atomically: a kill at any moment leaves
the previous checkpoint and ``latest`` as they were.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from mega_parallel_grid import ProcessGroups
from mega_pretrain.build import Built
from mega_pretrain.ckpt.buffers import saved_buffers
from mega_pretrain.ckpt.integrity import all_files, hash_files, rank_files, write_failure
from mega_pretrain.ckpt.meta import (
    FORMAT,
    LATEST_FILE,
    META_FILE,
    STEP_DIR,
    CheckpointError,
    LocalParam,
    barrier,
    gather_objects,
    layout_of,
    local_params,
    model_key,
    natural_key,
    optim_prefix,
    step_dir_name,
)

__all__ = ["PendingSave", "finish_save", "prepare_save", "save_checkpoint"]

#: Param-group entries that say how the optimizer runs, not what it computes (not saved).
IMPLEMENTATION_KEYS = frozenset(
    {"params", "param_names", "foreach", "fused", "capturable", "differentiable"}
)


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _local_index(
    params: list[LocalParam], opt_state: dict[str, Any], groups: ProcessGroups
) -> dict[str, Any]:
    """What this rank holds: shapes, splits and optimizer pieces of each parameter."""
    entries: dict[str, dict[str, Any]] = {}
    for lp in params:
        if lp.path in entries:  # a tied copy held twice by one rank: save it once
            continue
        pieces = opt_state["params"][lp.opt_name]["pieces"] if lp.opt_name is not None else []
        fields = ["master", *pieces[0]["state"]] if pieces else []
        entries[lp.path] = {
            "shape": list(lp.shape), "padded_shape": list(lp.padded_shape), "dim": lp.dim,
            "num_shards": lp.num_shards, "label": lp.label, "expert": lp.expert, "etp": lp.etp,
            "dtype": str(lp.param.dtype).removeprefix("torch."), "trained": lp.opt_name is not None,
            "fields": fields, "pieces": [[p["start"], p["end"]] for p in pieces],
        }  # fmt: skip
    return {"pp": groups.rank("pp"), "tp": groups.rank("tp"), "params": entries}


def _holder(pp: int, tp: int, expert: bool) -> tuple[int, int]:
    """Which replica of a parameter a rank's optimizer pieces belong to.

    A dense parameter's state is split over the dp (and cp) ranks of one (pp, tp) pair. An
    expert parameter's is split over edp, which spans tp ranks when etp < tp: every rank
    holding the same expert shard is one replica, so all of them save their pieces.
    """
    return (pp, 0) if expert else (pp, tp)


def _canonical(indices: list[dict[str, Any]]) -> dict[tuple[str, str], tuple[int, int]]:
    """(path, label) -> the replica (``_holder``) whose ranks save its optimizer pieces.

    Replicas (a norm weight on every tp rank, a tied embedding on the first and the last
    stage) hold equal values cut into different pieces; one replica's pieces are saved.
    """
    best: dict[tuple[str, str], tuple[int, int]] = {}
    for index in indices:
        for path, entry in index["params"].items():
            holder = _holder(index["pp"], index["tp"], entry["expert"])
            key = (path, entry["label"])
            best[key] = min(best.get(key, holder), holder)
    return best


def _tensors(
    params: list[LocalParam],
    opt_state: dict[str, Any],
    mine: tuple[int, int],
    canonical: dict[tuple[str, str], tuple[int, int]],
) -> dict[str, Tensor]:
    """This rank's DCP items: its weights, and its optimizer pieces where it is the saver."""
    out: dict[str, Tensor] = {}
    for lp in params:
        key = model_key(lp.path, lp.label)
        if key in out:
            continue
        out[key] = lp.param.detach()
        holder = _holder(*mine, lp.expert)
        if lp.opt_name is None or canonical[(lp.path, lp.label)] != holder:
            continue
        for piece in opt_state["params"][lp.opt_name]["pieces"]:
            prefix = optim_prefix(lp.path, lp.label, piece["start"], piece["end"])
            out[f"{prefix}/master"] = piece["master"]
            for field, value in piece["state"].items():
                out[f"{prefix}/{field}"] = value
    return out


def _meta(
    step: int,
    trainer_state: dict[str, Any],
    layout: dict[str, int | None],
    indices: list[dict[str, Any]],
    canonical: dict[tuple[str, str], tuple[int, int]],
    opt_state: dict[str, Any],
) -> dict[str, Any]:
    params: dict[str, dict[str, Any]] = {}
    for index in indices:
        for path, e in index["params"].items():
            holder = _holder(index["pp"], index["tp"], e["expert"])
            entry = params.setdefault(path, {
                "shape": e["shape"], "padded_shape": e["padded_shape"], "dim": e["dim"],
                "num_shards": e["num_shards"], "dtype": e["dtype"], "trained": e["trained"],
                "fields": [], "model_keys": [], "optim": {},
            })  # fmt: skip
            if e["etp"] > 1:  # a stacked expert weight: one entry per etp slice of it
                entry["etp"] = e["etp"]
            assert entry["shape"] == e["shape"] and entry["dim"] == e["dim"], path
            key = model_key(path, e["label"])
            if key not in entry["model_keys"]:
                entry["model_keys"].append(key)
            if canonical[(path, e["label"])] != holder or not e["pieces"]:
                continue
            entry["fields"] = entry["fields"] or e["fields"]
            entry["optim"].setdefault(e["label"], []).extend(
                {"start": s, "end": t, "key": optim_prefix(path, e["label"], s, t)}
                for s, t in e["pieces"]
            )
    for entry in params.values():
        entry["model_keys"].sort()
        for pieces in entry["optim"].values():
            pieces.sort(key=lambda p: p["start"])
    groups = [
        {k: v for k, v in g.items() if k not in IMPLEMENTATION_KEYS and _plain(v)}
        for g in opt_state["param_groups"]
    ]
    return {
        "format": FORMAT,
        "step": step,
        "trainer_state": trainer_state,
        "layout": layout,
        "optimizer": {
            "type": opt_state["optimizer"],
            "num_steps": opt_state["num_steps"],
            "param_groups": groups,
            "loss_scaler": opt_state["loss_scaler"],
        },
        "params": {name: params[name] for name in sorted(params, key=natural_key)},
    }


def _rng_state(built: Built) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "tracker": built.rng.state_dict()}
    if built.rng.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(built.rng.device)
    return state


def _raise_first(errors: list[str | None]) -> None:
    for error in errors:
        if error is not None:
            raise CheckpointError(error)


def _write_synced(file: Path, text: str) -> None:
    with open(file, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _commit(root: Path, tmp: Path, final: Path, keep_last: int, group: ProcessGroup) -> None:
    """Once every rank wrote its part: rename the folder, point ``latest`` at it, prune."""
    barrier(group)
    if dist.get_rank(group) == 0:
        if final.exists():  # the same step saved again: replace it
            old = root / f"{final.name}.old.tmp"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _write_synced(root / f"{LATEST_FILE}.tmp", final.name + "\n")
        os.replace(root / f"{LATEST_FILE}.tmp", root / LATEST_FILE)
        _prune(root, keep_last, final.name)
    barrier(group)


def _prune(root: Path, keep_last: int, current: str) -> None:
    """Delete leftover ``.tmp`` folders and all but the newest ``keep_last`` checkpoints."""
    steps = sorted(
        (int(m.group(1)), p.name)
        for p in root.iterdir()
        if p.is_dir() and (m := STEP_DIR.match(p.name))
    )
    kept = {name for _, name in steps[-keep_last:]} | {current}
    for _, name in steps:
        if name not in kept:
            shutil.rmtree(root / name, ignore_errors=True)
    for p in root.iterdir():
        if p.is_dir() and p.name.endswith(".tmp"):
            shutil.rmtree(p, ignore_errors=True)


@dataclass
class PendingSave:
    """A save whose tensors are chosen and whose folder exists, before its tensors are written."""

    root: Path
    """The run's ``checkpoints`` folder."""
    tmp: Path
    """Where this rank's files are written (``step_<step>.tmp``)."""
    final: Path
    """The folder the commit renames ``tmp`` to."""
    step: int
    keep_last: int
    tensors: dict[str, Tensor]
    """This rank's DCP items (live tensors, or their staged copies)."""
    rank_bytes: int
    """Bytes of ``tensors``: what this rank writes."""
    rng: dict[str, Any]
    """The RNG states at the moment of the save."""
    meta: dict[str, Any] | None
    """meta.json without its file digests (rank 0; None on the other ranks)."""


def _check_arguments(step: int, keep_last: int, trainer_state: dict[str, Any]) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step ({step!r}) must be a non-negative integer")
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last ({keep_last!r}) must be a positive integer")
    try:
        json.dumps(trainer_state)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"trainer_state is not JSON-serialisable ({exc}); pass numbers, strings, lists "
            "and dicts"
        ) from None


@torch.no_grad()
def prepare_save(
    run_dir: Path,
    step: int,
    built: Built,
    groups: ProcessGroups,
    trainer_state: dict[str, Any],
    keep_last: int = 2,
) -> PendingSave:
    """Everything of a save that reads the training state: the tensors each rank writes,
    the RNG states and meta.json; rank 0 makes the empty ``.tmp`` folder. Collective over
    all ranks."""
    _check_arguments(step, keep_last, trainer_state)
    root = Path(run_dir) / "checkpoints"
    final = root / step_dir_name(step)
    tmp = root / f"{final.name}.tmp"
    world = groups.world
    if dist.get_rank(world) == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    barrier(world)
    opt_state = built.optimizer.state_dict()  # also waits for in-flight parameter gathers
    params = local_params(built)
    index = _local_index(params, opt_state, groups)
    indices = gather_objects(index, world)
    canonical = _canonical(indices)
    with built.gathered_parameters():  # ZeRO-3: the full weights, copied out before freed
        tensors = _tensors(params, opt_state, (index["pp"], index["tp"]), canonical)
        if any(d.sharding == "parameters" and d.dp_size > 1 for d in built.ddps):
            tensors = {k: v.to("cpu", copy=True) if k.startswith("model/") else v
                       for k, v in tensors.items()}  # fmt: skip
    tensors.update(saved_buffers(built))  # e.g. MoE expert biases: the same on every rank
    meta = None
    if dist.get_rank(world) == 0:
        meta = _meta(step, trainer_state, layout_of(built, groups), indices, canonical, opt_state)
    return PendingSave(
        root=root, tmp=tmp, final=final, step=step, keep_last=keep_last, tensors=tensors,
        rank_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        rng=_rng_state(built), meta=meta,
    )  # fmt: skip


def finish_save(pending: PendingSave, group: ProcessGroup) -> Path:
    """Once every rank's tensors are written: the RNG files, the CRC-32 of each file in
    meta.json, then the commit (rename, ``latest``, keep-last pruning). Collective over
    ``group`` (all ranks); a failure on any rank raises CheckpointError on every rank."""
    tmp, rank = pending.tmp, dist.get_rank(group)
    error: str | None = None
    digests: dict[str, dict[str, Any]] = {}
    try:  # a failure here is said on every rank, not left to hang the commit's barrier
        torch.save(pending.rng, tmp / "rng" / f"rank{rank}.pt")
        digests = hash_files(tmp, rank_files(tmp, rank))
    except (OSError, RuntimeError) as exc:
        error = str(write_failure(tmp, exc, pending.rank_bytes))
    found = gather_objects((error, digests), group)
    _raise_first([e for e, _ in found])
    if pending.meta is not None:
        files: dict[str, dict[str, Any]] = {}
        for _, d in found:
            files.update(d)
        files.update(hash_files(tmp, set(all_files(tmp)) - set(files)))  # any file left over
        meta = {**pending.meta, "files": {name: files[name] for name in sorted(files)}}
        text = json.dumps(meta, indent=1)
        try:
            _write_synced(tmp / META_FILE, text)
        except OSError as exc:
            error = str(write_failure(tmp, exc, len(text)))
    _raise_first(gather_objects(error, group))
    _commit(pending.root, tmp, pending.final, pending.keep_last, group)
    return pending.final


def save_checkpoint(
    run_dir: Path,
    step: int,
    built: Built,
    groups: ProcessGroups,
    trainer_state: dict[str, Any],
    keep_last: int = 2,
) -> Path:
    """Save the model, optimizer and RNG states of every rank as ``<run_dir>/checkpoints/step_<step>``.

    Collective over all ranks. Each rank writes its own tensors (DCP deduplicates items
    several ranks hold, e.g. weights replicated over dp); rank 0 writes meta.json, then
    commits the folder, rewrites ``latest`` and keeps the newest ``keep_last`` checkpoints.
    Each rank hashes the files it wrote (CRC-32) and rank 0 records them in meta.json. A
    failed write (a full disk named as such) raises CheckpointError on every rank and
    leaves ``latest`` and the checkpoint it names as they were.
    Under ZeRO-3 (``parallel.sharding parameters``) the weights are saved whole, as at any
    stage: gathered once (``Built.gathered_parameters``) and copied to host memory before they
    are freed, so any stage and dp size loads them (the choice: one format for all
    stages; the cost is one full gather per save and a host copy of this rank's weights).
    ``trainer_state`` (config, consumed samples...) must be JSON-serialisable. Returns the
    checkpoint folder. (:class:`mega_pretrain.ckpt.async_save.AsyncSaver` writes in the
    background instead.)
    """
    pending = prepare_save(run_dir, step, built, groups, trainer_state, keep_last)
    try:
        dcp_save(pending.tensors, storage_writer=FileSystemWriter(pending.tmp),
                 process_group=groups.world)  # fmt: skip
    except CheckpointException as exc:
        raise write_failure(pending.tmp, exc, pending.rank_bytes) from None
    return finish_save(pending, groups.world)
