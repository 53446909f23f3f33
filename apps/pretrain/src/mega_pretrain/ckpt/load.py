"""load_checkpoint: rebuild this rank's shards of weights and optimizer state from any layout.

For each local parameter, the rows of the full tensor this rank holds (its tp shard, cut at
the real vocabulary size, padding rows zero) are copied out of the saved tp shards that
overlap them. Optimizer state is rebuilt the same way, for the rows whose state this dp
rank owns: the overlapping parts of the old tp shards are reassembled from their saved dp
pieces and sliced, and the result goes to DistributedOptimizer.load_state_dict as one shard
in its own format, which copies out exactly the pieces this rank owns. Under ZeRO-3 the
weights are written into the gathered parameters and the shards then rebuilt from the loaded
fp32 masters (the saved weights are those masters rounded, so they come back bitwise).

Adam's moments are read in the dtype they were saved in and converted to the one this run
keeps (``train.optimizer_moment_dtype``) by DistributedOptimizer.load_state_dict: fp32
rounded to nearest bf16, bf16 widened exactly. Converted rather than refused: the moment
dtype is a storage choice of the run, like its layout, not another optimizer, and the
conversion is the rounding a bf16 run applies after every step anyway.
"""

from __future__ import annotations

import math
import pickle
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from mega_parallel_grid import ProcessGroups
from mega_pretrain.build import Built
from mega_pretrain.ckpt.buffers import saved_buffers
from mega_pretrain.ckpt.integrity import verify_files
from mega_pretrain.ckpt.meta import (
    CheckpointError,
    LocalParam,
    cover_range,
    dcp_cause,
    dcp_failure,
    gather_objects,
    join_label,
    layout_of,
    local_params,
    model_key,
    one_line,
    read_meta,
    row_overlaps,
    shard_label,
)
from mega_pretrain.ckpt.reader import SafeReader, read_dcp_metadata
from mega_tp_layers import refresh_fp8_amax_histories
from mega_zero_optim import owned_pieces
from mega_zero_optim.state import FORMAT as OPTIMIZER_FORMAT

__all__ = ["load_checkpoint"]

#: Elements read by one DCP call at most (a parameter larger than this is read alone).
LOAD_BATCH = 1 << 27

Span = tuple[int, int]


@dataclass(frozen=True)
class _Source:
    """Rows (along the split dim) of one saved shard that land in this rank's tensor."""

    label: str
    old_shape: tuple[int, ...]
    src: Span
    dst: Span


@dataclass(frozen=True)
class _Part:
    """Optimizer state from one saved shard: its dim-0 rows ``old`` fill our rows ``new``.

    ``pieces`` are the saved dp pieces covering those rows once: (key prefix, elements of
    the piece, elements of the flattened rows).
    """

    source: _Source
    old: Span
    new: Span
    pieces: list[tuple[str, Span, Span]]


@dataclass(frozen=True)
class _Plan:
    lp: LocalParam
    dim: int | None
    sources: list[_Source]
    rows: Span
    """Dim-0 rows of this rank's tensor holding every element whose state this rank owns."""
    parts: list[_Part]
    fields: list[str]

    @property
    def model_keys(self) -> list[str]:
        return [model_key(self.lp.path, s.label) for s in self.sources]

    def keys(self) -> list[str]:
        return self.model_keys + [
            f"{key}/{field}"
            for part in self.parts
            for key, _, _ in part.pieces
            for field in self.fields
        ]


def _sources(path: Path, lp: LocalParam, m: dict[str, Any]) -> tuple[int | None, list[_Source]]:
    """The split dim, and which saved shards (which of their rows) fill this rank's tensor."""
    old_dim: int | None = m["dim"]
    if lp.dim is not None and old_dim is not None and lp.dim != old_dim:
        raise CheckpointError(
            f"parameter {lp.path!r} is split on dim {old_dim} in checkpoint {path} but on dim "
            f"{lp.dim} in this model; load a checkpoint of the same model"
        )
    old_shape = list(m["padded_shape"])
    n_old = m["num_shards"] if old_dim is not None else 1
    if old_dim is not None:
        old_shape[old_dim] //= n_old
    if not lp.shape:  # a scalar parameter
        return None, [_Source(lp.inner, (), (0, 0), (0, 0))]
    dim = lp.dim if lp.dim is not None else old_dim if old_dim is not None else 0
    rows = lp.shape[dim]
    want = (0, rows)
    if lp.dim is not None:
        per = lp.padded_shape[dim] // lp.num_shards
        start = lp.shard_rank * per
        want = (start, max(start, min(start + per, rows)))
    saved_rows = m["padded_shape"][dim] if old_dim is not None else rows
    outer = [shard_label(i, n_old) if old_dim is not None else "" for i in range(n_old)]
    return dim, [
        _Source(join_label(lp.inner, outer[i]), tuple(old_shape), src, dst)
        for i, src, dst in row_overlaps(saved_rows, n_old, rows, want)
    ]


def _parts(
    path: Path,
    lp: LocalParam,
    m: dict[str, Any],
    dim: int | None,
    sources: list[_Source],
    rows: Span,
) -> list[_Part]:
    """Where the optimizer state of our rows ``rows`` comes from."""
    parts = []
    for source in sources:
        if dim is None:  # scalar
            old, new = (0, 1), (0, 1)
        elif dim == 0:
            lo, hi = max(source.dst[0], rows[0]), min(source.dst[1], rows[1])
            if lo >= hi:
                continue
            old = (source.src[0] + lo - source.dst[0], source.src[0] + hi - source.dst[0])
            new = (lo - rows[0], hi - rows[0])
        else:  # dim 0 is not split: the same rows in every shard
            old, new = rows, (0, rows[1] - rows[0])
        row_size = math.prod(source.old_shape[1:])
        pieces = cover_range(
            m["optim"].get(source.label, []), (old[0] * row_size, old[1] * row_size)
        )
        if pieces is None:
            raise CheckpointError(
                f"the saved optimizer pieces of {lp.path!r} {source.label or '(replicated)'} "
                f"in checkpoint {path} do not cover rows {old[0]}-{old[1]}; the checkpoint "
                "is damaged, load an earlier one"
            )
        parts.append(_Part(source, old, new, pieces))
    return parts


def _owned_rows(built: Built) -> dict[int, Span]:
    """id(param) -> the dim-0 rows holding the elements whose state this dp rank owns."""
    spans: dict[int, Span] = {}
    for ddp in built.optimizer.ddps:
        for buffer in ddp.param_and_grad_buffers:
            for bucket in buffer.buckets:
                for piece in owned_pieces(buffer.ranges, bucket.shard):
                    p = buffer.params[piece.index]
                    row = max(1, math.prod(p.shape[1:])) if p.dim() else 1
                    lo, hi = piece.in_param.start // row, -(-piece.in_param.end // row)
                    old = spans.get(id(p), (lo, hi))
                    spans[id(p)] = (min(old[0], lo), max(old[1], hi))
    return spans


def _plan(path: Path, lp: LocalParam, m: dict[str, Any], owned: dict[int, Span]) -> _Plan:
    dim, sources = _sources(path, lp, m)
    rows = owned.get(id(lp.param), (0, 0)) if lp.opt_name is not None else (0, 0)
    if rows[0] >= rows[1]:
        return _Plan(lp, dim, sources, rows, [], [])
    if not m["fields"]:
        raise CheckpointError(
            f"checkpoint {path} holds no optimizer state for parameter {lp.path!r}, which this "
            "model trains; load a checkpoint of the same model and optimizer"
        )
    return _Plan(lp, dim, sources, rows, _parts(path, lp, m, dim, sources, rows), list(m["fields"]))


def _batches(plans: list[_Plan], sizes: dict[str, int]) -> Iterator[list[_Plan]]:
    batch: list[_Plan] = []
    total = 0
    for plan in plans:
        n = sum(sizes[k] for k in plan.keys())
        if batch and total + n > LOAD_BATCH:
            yield batch
            batch, total = [], 0
        batch.append(plan)
        total += n
    if batch:
        yield batch


def _read(path: Path, keys: list[str], index: dict[str, Any]) -> dict[str, Tensor]:
    """The saved tensors ``keys``, on the CPU (each rank reads alone: no collective)."""
    out: dict[str, Tensor] = {}
    for key in keys:
        item = index.get(key)
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint {path} lacks tensor {key!r} that its meta.json lists; the "
                "checkpoint is damaged, load an earlier one"
            )
        out[key] = torch.empty(item.size, dtype=item.properties.dtype)
    try:
        with warnings.catch_warnings():  # no_dist is meant: every rank reads its own keys
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(out, storage_reader=SafeReader(path), no_dist=True)
    except (CheckpointException, Exception) as exc:
        cause = dcp_cause(exc)
        if isinstance(cause, CheckpointError):  # the reader's own sentence
            raise CheckpointError(str(cause)) from None
        raise CheckpointError(
            f"cannot read the tensors of checkpoint {path} ({dcp_failure(exc)}); the files "
            "are truncated or missing, load an earlier checkpoint"
        ) from None
    return out


def _copy_along(into: Tensor, old: Tensor, dim: int | None, src: Span, dst: Span) -> None:
    if dim is None:
        into.copy_(old.view(into.shape))
        return
    into.narrow(dim, dst[0], dst[1] - dst[0]).copy_(old.narrow(dim, src[0], src[1] - src[0]))


def _fill_weight(plan: _Plan, loaded: dict[str, Tensor]) -> None:
    """Copy the rows each saved shard gives into the parameter; padding rows are zeroed."""
    into = plan.lp.param.data
    into.zero_()
    for source, key in zip(plan.sources, plan.model_keys, strict=True):
        _copy_along(into, loaded[key], plan.dim, source.src, source.dst)


def _optimizer_entry(plan: _Plan, loaded: dict[str, Tensor]) -> dict[str, Any]:
    """The parameter's entry in the synthetic shard: one piece spanning our owned rows."""
    shape = tuple(plan.lp.param.shape)
    if not plan.parts:
        return {"shape": list(shape), "pieces": []}
    r0, r1 = plan.rows
    row_size = math.prod(shape[1:]) if shape else 1
    block = (r1 - r0, *shape[1:]) if shape else ()
    values: dict[str, Tensor] = {}
    for field in plan.fields:
        for part in plan.parts:
            first = loaded[f"{part.pieces[0][0]}/{field}"]
            if first.dim() == 0:  # a per-parameter scalar (Adam's step)
                values.setdefault(field, first.clone())
                continue
            old_rows = part.old[1] - part.old[0]
            flat = torch.empty(old_rows * math.prod(part.source.old_shape[1:]), dtype=first.dtype)
            for key, (s, e), (a, b) in part.pieces:
                flat[a:b] = loaded[f"{key}/{field}"][s:e]
            old = flat.view((old_rows, *part.source.old_shape[1:]) if shape else ())
            into = values.setdefault(field, torch.zeros(block, dtype=first.dtype))
            if plan.dim is None:
                into.copy_(old)
            elif plan.dim == 0:  # whole rows
                into[part.new[0] : part.new[1]] = old
            else:
                _copy_along(into, old, plan.dim, part.source.src, part.source.dst)
    master = values.pop("master").reshape(-1)
    state = {k: v.reshape(-1) if v.dim() else v for k, v in values.items()}
    piece = {"start": r0 * row_size, "end": r1 * row_size, "master": master, "state": state}
    return {"shape": list(shape), "pieces": [piece]}


def _param_groups(built: Built, saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The saved hyperparameters, typed as the current groups hold them (tuples stay tuples)."""
    out = []
    for current, group in zip(built.optimizer.param_groups, saved, strict=True):
        out.append({
            k: tuple(v) if isinstance(current.get(k), tuple) and isinstance(v, list) else v
            for k, v in group.items()
        })  # fmt: skip
    return out


def _check(path: Path, meta: dict[str, Any], params: list[LocalParam], built: Built) -> None:
    for lp in params:
        m = meta["params"].get(lp.path)
        if m is None:
            raise CheckpointError(
                f"parameter {lp.path!r} of this model is not in checkpoint {path}; load a "
                "checkpoint of the same model"
            )
        saved_etp = m.get("etp", 1)
        if saved_etp != lp.etp:
            raise CheckpointError(
                f"stacked expert weight {lp.path!r} is split over etp {saved_etp} in checkpoint "
                f"{path} but over etp {lp.etp} here, and such weights do not reshard across "
                f"etp; resume with parallel.etp {saved_etp}"
            )
        if tuple(m["shape"]) != lp.shape:
            raise CheckpointError(
                f"parameter {lp.path!r} has shape {tuple(m['shape'])} in checkpoint {path} but "
                f"{lp.shape} in this model; load a checkpoint of the same model"
            )
    opt = meta["optimizer"]
    mine = type(built.optimizer.optimizer).__name__
    if opt["type"] != mine:
        raise CheckpointError(
            f"checkpoint {path} holds {opt['type']} state but this optimizer is {mine}; "
            "build the same optimizer"
        )
    if len(opt["param_groups"]) != len(built.optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint {path} has {len(opt['param_groups'])} parameter groups but the "
            f"optimizer has {len(built.optimizer.param_groups)}; build the same optimizer"
        )


def _load_local(
    path: Path, meta: dict[str, Any], params: list[LocalParam], built: Built
) -> dict[str, Any]:
    """Copy this rank's weights in place; return the optimizer shard to load (no collective)."""
    index = read_dcp_metadata(path).state_dict_metadata
    owned = _owned_rows(built)
    plans = [_plan(path, lp, meta["params"][lp.path], owned) for lp in params]
    sizes = {}
    for plan in plans:
        for key in plan.keys():
            item = index.get(key)
            sizes[key] = item.size.numel() if isinstance(item, TensorStorageMetadata) else 0
    entries: dict[str, Any] = {}
    for batch in _batches(plans, sizes):
        loaded = _read(path, sorted({k for plan in batch for k in plan.keys()}), index)
        for plan in batch:
            _fill_weight(plan, loaded)
            if plan.lp.opt_name is not None:
                entries[plan.lp.opt_name] = _optimizer_entry(plan, loaded)
    opt = meta["optimizer"]
    return {
        "format": OPTIMIZER_FORMAT,
        "optimizer": opt["type"],
        "dp_size": 1,
        "dp_rank": 0,
        "num_steps": opt["num_steps"],
        "param_groups": _param_groups(built, opt["param_groups"]),
        "loss_scaler": opt["loss_scaler"],
        "params": entries,
    }


def _restore_rng(path: Path, built: Built, rank: int) -> None:
    file = path / "rng" / f"rank{rank}.pt"
    try:
        state = torch.load(file, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise CheckpointError(
            f"cannot read the RNG states {file} ({one_line(str(exc), 150)}); the checkpoint is "
            "damaged, load an earlier one"
        ) from None
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and built.rng.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], built.rng.device)
    built.rng.load_state_dict(state["tracker"])


def _raise_first(errors: list[str | None]) -> None:
    for error in errors:
        if error is not None:
            raise CheckpointError(error)


@torch.no_grad()
def load_checkpoint(path: Path, built: Built, groups: ProcessGroups) -> dict[str, Any]:
    """Load checkpoint folder ``path`` into ``built``, whatever layout it was saved at.

    Collective over all ranks. Weights and optimizer state are resharded to this run's tp,
    pp, vpp, dp, cp and ep (stacked expert weights, GroupedMLP's, only at their saved etp:
    another etp is refused in one sentence); RNG states are restored only when the layout
    and world size are the saved ones (else the current ones stay). Returns the saved trainer state plus
    ``rng_restored`` (bool). Raises CheckpointError, on every rank, when the checkpoint is
    missing, damaged or of another model (the weights may then be partly overwritten). Every
    file is checked against its saved CRC-32 first (the ranks share the files), or for
    checkpoints saved without checksums against the sizes the DCP index gives.
    """
    path = Path(path)
    world = groups.world
    params = local_params(built)
    meta: dict[str, Any] = {}
    error: str | None = None
    try:
        meta = read_meta(path)
        _check(path, meta, params, built)
        error = verify_files(path, meta, (dist.get_rank(world), dist.get_world_size(world)))
    except CheckpointError as exc:
        error = str(exc)
    found = gather_objects((error, sorted({lp.path for lp in params})), world)
    _raise_first([e for e, _ in found])
    held = {name for _, names in found for name in names}
    extra = sorted(set(meta["params"]) - held)
    if extra:
        raise CheckpointError(
            f"checkpoint {path} holds parameter {extra[0]!r} ({len(extra)} in all) that this "
            "model does not have; load it into the model it was saved from"
        )
    same_layout = meta["layout"] == layout_of(built, groups)
    shard: dict[str, Any] = {}
    try:
        with built.gathered_parameters():  # ZeRO-3: written, then rebuilt from the masters
            shard = _load_local(path, meta, params, built)
        if same_layout:
            _restore_rng(path, built, dist.get_rank(world))
    except CheckpointError as exc:
        error = str(exc)
    _raise_first(gather_objects(error, world))
    built.optimizer.load_state_dict(shard)
    wanted = saved_buffers(built)
    index = read_dcp_metadata(path).state_dict_metadata
    present = sorted(key for key in wanted if key in index)  # checkpoints before buffers: none
    for key, value in _read(path, present, index).items():
        wanted[key].copy_(value)
    refresh_fp8_amax_histories(built.chunks)  # loaded amax histories scale the next step
    return {**meta["trainer_state"], "rng_restored": same_layout}
