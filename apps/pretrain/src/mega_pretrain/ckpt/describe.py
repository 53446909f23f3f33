"""What ``mega-pretrain inspect`` prints: a summary with an integrity verdict, tensors on request."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mega_pretrain.ckpt.integrity import all_files, verify_files
from mega_pretrain.ckpt.meta import (
    LATEST_FILE,
    META_FILE,
    STEP_DIR,
    CheckpointError,
    latest_in,
    natural_key,
    read_meta,
)
from mega_pretrain.ckpt.reader import read_dcp_metadata

__all__ = ["CheckpointReport", "describe_checkpoint", "inspect_checkpoint", "resolve_checkpoint"]


@dataclass(frozen=True)
class CheckpointReport:
    """The text ``inspect`` prints, and the damage it found (None: the files are intact)."""

    text: str
    damage: str | None


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder, or the one ``latest`` names in a run folder or checkpoints folder."""
    path = Path(path)
    if (path / META_FILE).exists() or STEP_DIR.match(path.name) or not path.is_dir():
        return path
    for root in (path / "checkpoints", path):
        if (root / LATEST_FILE).is_file():
            found = latest_in(root)
            assert found is not None
            return found
    raise CheckpointError(
        f"{path} holds no meta.json and no latest file; pass a run folder, its checkpoints "
        "folder or a checkpoint folder step_NNNNNNNN"
    )


def _flatten(prefix: str, value: Any, out: list[str]) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out.append(f"  {prefix} = {json.dumps(value)}")


def _last_loss(path: Path, step: int) -> str:
    """The last training loss at or before ``step`` in the run folder's metrics.jsonl."""
    file = path.parent.parent / "metrics.jsonl"
    if path.parent.name != "checkpoints" or not file.is_file():
        return "not recorded"
    found: tuple[int, float] | None = None
    for line in file.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(rec, dict) or rec.get("kind", "train") != "train":
            continue
        s, loss = rec.get("step"), rec.get("loss")
        if isinstance(s, int) and s <= step and isinstance(loss, (int, float)):
            if found is None or s >= found[0]:
                found = (s, float(loss))
    return f"{found[1]:.4f} (step {found[0]}, {file})" if found else "not recorded"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _tensor_lines(path: Path, meta: dict[str, Any]) -> list[str]:
    lines = [f"parameters ({len(meta['params'])}):"]
    for name, p in meta["params"].items():
        split = "replicated" if p["dim"] is None else f"dim {p['dim']} in {p['num_shards']}"
        pieces = sum(len(v) for v in p["optim"].values())
        lines.append(f"  {name} {list(p['shape'])} {p['dtype']} ({split}, {pieces} optim pieces)")
    items = read_dcp_metadata(path).state_dict_metadata
    lines.append(f"tensors ({len(items)}):")
    for key in sorted(items, key=natural_key):
        item = items[key]
        if isinstance(item, TensorStorageMetadata):
            dtype = str(item.properties.dtype).removeprefix("torch.")
            lines.append(f"  {key} {list(item.size)} {dtype}")
        else:
            lines.append(f"  {key} (bytes)")
    return lines


def inspect_checkpoint(path: Path, *, tensors: bool = False) -> CheckpointReport:
    """Summary of checkpoint ``path`` (or of the one ``latest`` names), files checked.

    Step, parameters, size on disk, last loss, layout, optimizer and an integrity verdict
    (every file against its saved CRC-32; sizes against the DCP index for checkpoints
    saved without checksums); with ``tensors`` also the trainer state and every
    parameter and tensor. No tensor is loaded and nothing in a file is run.
    """
    path = resolve_checkpoint(path)
    meta = read_meta(path)
    try:
        damage = verify_files(path, meta)
    except CheckpointError as exc:  # an unreadable or refused DCP index
        damage = str(exc)
    files = meta.get("files")
    how = (
        f"{len(files)} files match their CRC-32"
        if isinstance(files, dict)
        else "shard sizes match the index (saved without checksums)"
    )
    numel = sum(math.prod(p["shape"]) for p in meta["params"].values())
    size = (
        sum((path / n).stat().st_size for n in all_files(path)) + (path / META_FILE).stat().st_size
    )
    opt = meta["optimizer"]
    lines = [
        f"checkpoint {path}",
        f"step: {meta['step']}",
        f"parameters: {numel:,} in {len(meta['params'])} tensors",
        f"size on disk: {_mib(size)}",
        f"last loss: {_last_loss(path, meta['step'])}",
        f"layout: {' '.join(f'{k}={v}' for k, v in meta['layout'].items())}",
        f"optimizer: {opt.get('type')}, {opt.get('num_steps')} steps, "
        f"{len(opt.get('param_groups', []))} param groups",
        f"integrity: {'DAMAGED: ' + damage if damage else 'ok, ' + how}",
    ]
    if tensors:
        lines.append("trainer state:")
        _flatten("", meta["trainer_state"], lines)
        if damage is None:
            lines += _tensor_lines(path, meta)
    return CheckpointReport("\n".join(lines), damage)


def describe_checkpoint(path: Path, *, tensors: bool = False) -> str:
    """The text of :func:`inspect_checkpoint`."""
    return inspect_checkpoint(path, tensors=tensors).text
