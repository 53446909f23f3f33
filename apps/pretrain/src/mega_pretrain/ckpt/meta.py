"""What a checkpoint holds: tensor keys, the parameters of this rank, meta.json, latest.

A checkpoint is a folder ``<run_dir>/checkpoints/step_<step:08d>`` with

* ``meta.json``: the step, the trainer state, the layout it was saved at, and for every
  parameter (by its chunk-independent path, global layer indices) the full shape without
  vocabulary padding, how it was split and the keys of its optimizer pieces; and the
  ``size`` and ``crc32`` of every other file (``files``, absent in older checkpoints);
* torch.distributed.checkpoint files (``.metadata``, ``__<rank>_0.distcp``) with the tensors
  keyed ``model/<path>`` (replicated over tp), ``model/<path>/tp<r>of<n>`` (a tp shard) and
  ``optim/<path>[/tp<r>of<n>]/<start>-<end>/<field>`` (a dp rank's piece of the flattened
  local shard: ``master``, ``exp_avg``, ``exp_avg_sq``, scalar ``step``); a stacked expert
  weight (GroupedMLP: split over ep on dim 0, cut over etp inside) puts ``etp<t>of<T>/``
  before its ``tp<r>of<n>`` (its meta.json entry records ``etp``; its shape is one slice);
* ``rng/rank<r>.pt``: each rank's RNG states (tensors only).

Nothing here runs collectives; everything that reads a file raises :class:`CheckpointError`
in one sentence.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.api import CheckpointException

from mega_moe import expert_shard
from mega_parallel_grid import ProcessGroups
from mega_pretrain.build import Built
from mega_tp_layers import ColumnParallelLinear, VocabParallelEmbedding, shard_spec

__all__ = [
    "FORMAT",
    "LATEST_FILE",
    "META_FILE",
    "STEP_DIR",
    "CheckpointError",
    "LocalParam",
    "barrier",
    "cover_range",
    "dcp_cause",
    "dcp_failure",
    "earlier_checkpoint",
    "gather_objects",
    "join_label",
    "latest_checkpoint",
    "latest_in",
    "layout_of",
    "local_params",
    "model_key",
    "natural_key",
    "newest_checkpoint",
    "one_line",
    "optim_prefix",
    "optimizer_names",
    "read_meta",
    "row_overlaps",
    "shard_label",
    "step_dir_name",
]

#: Format tag written into meta.json; bumped when the layout of the folder changes.
FORMAT = "mega_pretrain.checkpoint/1"
META_FILE = "meta.json"
LATEST_FILE = "latest"
STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (missing, damaged, or from another model)."""


def one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line, at most ``limit`` characters (for error sentences)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def dcp_cause(exc: BaseException) -> BaseException:
    """The exception behind what torch.distributed.checkpoint raised.

    ``CheckpointException.failures`` maps each failed rank to ``(exception, traceback)``;
    the first rank's exception is the cause (unwrapped again if it is itself one).
    """
    for _ in range(4):
        failures = getattr(exc, "failures", None)
        if not isinstance(exc, CheckpointException) or not isinstance(failures, dict):
            break
        if not failures:
            break
        first = failures[min(failures)]
        inner = first[0] if isinstance(first, tuple) and first else first
        inner = getattr(inner, "exception", inner)
        if not isinstance(inner, BaseException):
            break
        exc = inner
    return exc


def dcp_failure(exc: BaseException, limit: int = 300) -> str:
    """A one-line summary of what torch.distributed.checkpoint raised: its cause, named."""
    cause = dcp_cause(exc)
    text = " ".join(str(cause).split())
    return one_line(f"{type(cause).__name__}: {text}", limit)


def natural_key(name: str) -> tuple[int, list[tuple[int, str]]]:
    """Sort key putting the embedding first, then layers by number, then the head.

    >>> sorted(["output.weight", "layers.10.w", "layers.9.w", "embedding.word.weight"], key=natural_key)
    ['embedding.word.weight', 'layers.9.w', 'layers.10.w', 'output.weight']
    """
    bare = name.removeprefix("model/").removeprefix("optim/")
    group = (
        0 if bare.startswith("embedding") else 2 if bare.startswith(("final_norm", "output")) else 1
    )
    parts = re.split(r"(\d+)", name)
    return group, [(int(p), "") if p.isdigit() else (-1, p) for p in parts]


def step_dir_name(step: int) -> str:
    """The folder name of the checkpoint of ``step``."""
    return f"step_{step:08d}"


def shard_label(rank: int, num_shards: int) -> str:
    """The key part naming tp shard ``rank`` of ``num_shards``."""
    return f"tp{rank}of{num_shards}"


def model_key(path: str, label: str) -> str:
    """DCP key of a parameter's weight (``label`` empty: replicated over tp)."""
    return f"model/{path}/{label}" if label else f"model/{path}"


def optim_prefix(path: str, label: str, start: int, end: int) -> str:
    """DCP key prefix of one optimizer piece (append ``/<field>``)."""
    base = f"optim/{path}/{label}" if label else f"optim/{path}"
    return f"{base}/{start}-{end}"


@dataclass(frozen=True)
class LocalParam:
    """One parameter of this rank and how it sits in the full tensor."""

    path: str
    """Chunk-independent name (``layers.5.attention.qkv.weight``)."""
    opt_name: str | None
    """Its name in the DistributedOptimizer's state dict; None when it is not trained."""
    param: nn.Parameter
    dim: int | None
    """Dimension split over tp; None when every tp rank holds the whole tensor."""
    num_shards: int
    shard_rank: int
    shape: tuple[int, ...]
    """Full shape without vocabulary padding."""
    padded_shape: tuple[int, ...]
    """Full shape with vocabulary padding (what the shards split)."""
    expert: bool = False
    """An expert parameter: its optimizer state is split over edp, not over dp."""
    etp: int = 1
    """etp slices of a stacked expert weight (GroupedMLP): its ``shape`` is one slice, the
    ep split of ``dim`` 0 is described by the fields above, the etp split by this."""
    etp_rank: int = 0

    @property
    def inner(self) -> str:
        """The key part naming this rank's etp slice of a stacked expert weight, or empty."""
        return f"etp{self.etp_rank}of{self.etp}" if self.etp > 1 else ""

    @property
    def label(self) -> str:
        """The key part of this rank's shard; empty when replicated over tp."""
        outer = "" if self.dim is None else shard_label(self.shard_rank, self.num_shards)
        return join_label(self.inner, outer)


def join_label(inner: str, outer: str) -> str:
    """A shard's key part: the etp slice (if any), then the split of ``dim``."""
    return f"{inner}/{outer}" if inner and outer else inner or outer


def _real_rows(chunk: nn.Module) -> dict[str, int]:
    """Parameter path -> real rows along dim 0, for the padded vocabulary tensors."""
    real: dict[str, int] = {}
    for mod_name, mod in chunk.named_modules():
        if isinstance(mod, VocabParallelEmbedding):
            rows = mod.num_embeddings
        elif isinstance(mod, ColumnParallelLinear):
            rows = mod.out_features
        else:
            continue
        for p_name, p in mod.named_parameters():
            spec = shard_spec(p)
            if spec is not None and spec.dim == 0 and spec.full_shape[0] > rows:
                real[f"{mod_name}.{p_name}" if mod_name else p_name] = rows
    return real


def optimizer_names(built: Built) -> dict[int, str]:
    """id(parameter) -> its name in the DistributedOptimizer's state dict."""
    ddps = built.optimizer.ddps
    names: dict[int, str] = {}
    for i, ddp in enumerate(ddps):
        prefix = f"{i}." if len(ddps) > 1 else ""
        for buffer in ddp.param_and_grad_buffers:
            for name, p in zip(buffer.names, buffer.params, strict=True):
                names[id(p)] = prefix + name
    return names


def local_params(built: Built) -> list[LocalParam]:
    """Every parameter of this rank's chunks, in chunk order."""
    opt_names = optimizer_names(built)
    out: list[LocalParam] = []
    for chunk in built.chunks:
        real = _real_rows(chunk)
        for path, p in chunk.named_parameters():
            spec = shard_spec(p)
            padded = tuple(spec.full_shape) if spec is not None else tuple(p.shape)
            dim = spec.dim if spec is not None else None
            n, r = (spec.num_shards, spec.shard_rank) if spec and dim is not None else (1, 0)
            shape = list(padded)
            if path in real and dim == 0:
                shape[0] = real[path]
            expert = expert_shard(p)
            # a stacked expert weight's spec describes its ep split only: the etp slice
            # (same spec, other values on each etp rank) is named in its keys
            etp, etp_rank = (expert.etp, expert.etp_rank) if expert and expert.stacked else (1, 0)
            out.append(LocalParam(
                path, opt_names.get(id(p)), p, dim, n, r, tuple(shape), padded,
                expert=expert is not None, etp=etp, etp_rank=etp_rank,
            ))  # fmt: skip
    return out


def row_overlaps(
    saved_rows: int, saved_shards: int, real_rows: int, want: tuple[int, int]
) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """Which rows of which saved shard fill rows ``want`` of the full tensor.

    The saved tensor's ``saved_rows`` (padding included) were cut into ``saved_shards``
    equal shards; rows at or past ``real_rows`` are padding and never copied. Returns
    ``(shard, rows inside that shard, rows counted from want[0])`` for each overlap.

    >>> row_overlaps(258, 2, 257, (0, 257))
    [(0, (0, 129), (0, 129)), (1, (0, 128), (129, 257))]
    >>> row_overlaps(257, 1, 257, (129, 257))
    [(0, (129, 257), (0, 128))]
    """
    per = saved_rows // saved_shards
    out = []
    for i in range(saved_shards):
        lo = max(want[0], i * per)
        hi = min(want[1], (i + 1) * per, real_rows)
        if lo < hi:
            out.append((i, (lo - i * per, hi - i * per), (lo - want[0], hi - want[0])))
    return out


def layout_of(built: Built, groups: ProcessGroups) -> dict[str, int | None]:
    """The parallel layout of this run, as meta.json records it."""
    return {
        "tp": groups.size("tp"), "pp": groups.size("pp"), "cp": groups.size("cp"),
        "dp": groups.size("dp"), "ep": groups.size("ep"),
        "vpp": len(built.chunks) if len(built.chunks) > 1 else None,
        "world_size": dist.get_world_size(groups.world),
    }  # fmt: skip


def gather_objects(obj: Any, group: ProcessGroup) -> list[Any]:
    """Every rank's ``obj`` (all-gather of small Python objects; no collective on one rank)."""
    size = dist.get_world_size(group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: ProcessGroup) -> None:
    """Wait for every rank of ``group`` (nothing on one rank)."""
    if dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def cover_range(
    pieces: list[dict[str, Any]], want: tuple[int, int]
) -> list[tuple[str, tuple[int, int], tuple[int, int]]] | None:
    """Saved pieces (``start``, ``end``, ``key``) covering elements ``want`` once.

    Returns ``(key, elements of the piece, elements counted from want[0])`` for each piece
    used, or None when some element is in no piece. Overlapping pieces (equal replicas) are
    fine: each element is taken once.

    >>> cover_range([{"start": 0, "end": 4, "key": "a"}, {"start": 4, "end": 9, "key": "b"}], (2, 6))
    [('a', (2, 4), (0, 2)), ('b', (0, 2), (2, 4))]
    >>> cover_range([{"start": 0, "end": 4, "key": "a"}], (2, 6)) is None
    True
    """
    out = []
    done = want[0]
    for p in sorted(pieces, key=lambda p: (p["start"], p["end"])):
        if done >= want[1]:
            break
        start, end = p["start"], min(p["end"], want[1])
        if end <= done:
            continue
        if start > done:
            return None
        out.append((p["key"], (done - start, end - start), (done - want[0], end - want[0])))
        done = end
    return out if done >= want[1] else None


def read_meta(path: Path) -> dict[str, Any]:
    """The parsed meta.json of checkpoint folder ``path`` (CheckpointError if unusable)."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(
            f"{path} is a file, not a checkpoint folder; pass the folder written by "
            f"save_checkpoint (<run_dir>/checkpoints/step_NNNNNNNN), e.g. {path.parent}"
        )
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint folder {path} does not exist; pass a folder written by save_checkpoint "
            "(<run_dir>/checkpoints/step_NNNNNNNN)"
        )
    file = path / META_FILE
    if not file.is_file():
        written = STEP_DIR.match(path.name.removesuffix(".tmp")) or any(path.glob("*.distcp"))
        if not written:  # a run folder passed for its checkpoint, or some other folder
            raise CheckpointError(_not_a_checkpoint(path))
        raise CheckpointError(
            f"checkpoint folder {path} has no {META_FILE}, so its save did not finish; "
            "load an earlier checkpoint"
        )
    try:
        meta = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{file} is not valid JSON ({one_line(str(exc))}); the checkpoint is damaged, "
            "load an earlier one"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(
            f"{file} does not describe a mega checkpoint (format {found!r}, expected "
            f"{FORMAT!r}); pass a folder written by save_checkpoint"
        )
    missing = [
        k for k in ("step", "trainer_state", "layout", "params", "optimizer") if k not in meta
    ]
    if missing:
        raise CheckpointError(
            f"{file} lacks {', '.join(missing)}; the checkpoint is damaged, load an earlier one"
        )
    kinds = {"params": dict, "layout": dict, "optimizer": dict, "trainer_state": dict, "step": int}
    wrong = [k for k, kind in kinds.items() if not isinstance(meta[k], kind)]
    if wrong:
        raise CheckpointError(
            f"{file} holds a malformed {', '.join(wrong)}; the checkpoint is damaged, load an "
            "earlier one"
        )
    return meta


def _not_a_checkpoint(path: Path) -> str:
    """The sentence for a folder without meta.json that is not named like a checkpoint."""
    for root in (path / "checkpoints", path):
        holds_steps = root.is_dir() and any(STEP_DIR.match(p.name) for p in root.iterdir())
        if not holds_steps and not (root / LATEST_FILE).is_file():
            continue
        try:
            found = latest_in(root) or newest_checkpoint(root)
        except CheckpointError:
            found = newest_checkpoint(root)
        way = (
            f"pass a checkpoint folder such as {found}"
            if found is not None
            else "it holds no complete checkpoint, so start fresh with --checkpoint.load none"
        )
        return (
            f"{path} is a run or checkpoints folder, not a checkpoint folder (it has no "
            f"{META_FILE}); {way}"
        )
    return (
        f"{path} has no {META_FILE}, so it is not a checkpoint folder; pass a folder written "
        "by save_checkpoint (<run_dir>/checkpoints/step_NNNNNNNN)"
    )


def newest_checkpoint(root: Path, below: int | None = None) -> Path | None:
    """The newest complete (meta.json written) checkpoint in ``root`` before step ``below``."""
    best: tuple[int, Path] | None = None
    for p in root.iterdir() if root.is_dir() else ():
        m = STEP_DIR.match(p.name)
        if m is None or not (p / META_FILE).is_file():
            continue
        step = int(m.group(1))
        if (below is None or step < below) and (best is None or step > best[0]):
            best = (step, p)
    return best[1] if best else None


def earlier_checkpoint(path: Path) -> Path | None:
    """The newest complete checkpoint beside ``path`` that is older than it (None: none)."""
    path = Path(path)
    m = STEP_DIR.match(path.name)
    if m is None:  # a copy under another name: any checkpoint beside it
        return newest_checkpoint(path.parent)
    return newest_checkpoint(path.parent, below=int(m.group(1)))


def latest_in(root: Path) -> Path | None:
    """The folder ``<root>/latest`` names, or None when there is no such file."""
    file = root / LATEST_FILE
    if not file.is_file():
        return None
    name = file.read_text().strip()
    if not STEP_DIR.match(name):
        raise CheckpointError(
            f"{file} names {name!r}, not a checkpoint folder step_NNNNNNNN; delete the file "
            "or write the name of a checkpoint folder into it"
        )
    path = root / name
    if not path.is_dir():
        earlier = newest_checkpoint(root)
        out = (
            f"the newest complete checkpoint is {earlier}: resume from it with "
            f"--checkpoint.load {earlier}"
            if earlier is not None
            else "no complete checkpoint is left: start fresh with --checkpoint.load none"
        )
        raise CheckpointError(f"{file} names {name}, which no longer exists; {out}")
    return path


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The folder ``<run_dir>/checkpoints/latest`` names, or None when there is no such file.

    Raises CheckpointError, naming the newest complete checkpoint left, when that folder
    is gone.
    """
    return latest_in(Path(run_dir) / "checkpoints")
