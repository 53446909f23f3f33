"""The one storage reader every checkpoint read goes through; it never runs code from a file.

torch.distributed.checkpoint's ``FileSystemReader`` reads the ``.metadata`` index with plain
``pickle.load`` (a planted pickle runs whatever it names) and non-tensor items with
``torch.load(weights_only=False)``. :class:`SafeReader` unpickles the index with a
``find_class`` allow-list of the plain data classes DCP metadata is made of, and refuses
non-tensor items (mega never saves any). Tensor items are read as torch does, with
``torch.load(weights_only=True)``.

Why an own allow-list rather than torch's weights-only unpickler: ``.metadata`` is a bare
pickle, not a ``torch.save`` archive, so ``torch.load`` cannot read it, and the unpickler
behind it is private; ``pickle.Unpickler.find_class`` is the standard library's documented
way to restrict globals, and the list below names every global the index may hold.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from mega_pretrain.ckpt.meta import CheckpointError, one_line

__all__ = ["METADATA_FILE", "SafeReader", "read_dcp_metadata"]

#: DCP's index file in a checkpoint folder.
METADATA_FILE = ".metadata"

#: module -> the globals a DCP index may name (dtypes are checked apart: ``torch.<dtype>``).
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        "Metadata MetadataIndex StorageMeta TensorStorageMetadata BytesStorageMetadata "
        "ChunkStorageMetadata TensorProperties _MEM_FORMAT_ENCODING".split()
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),
    "torch.serialization": frozenset({"_get_layout"}),  # torch.strided, by name, from a table
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class _Refused(Exception):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


def _refuse(file: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"{file} {what}, which no mega/DCP checkpoint metadata does: it is not a checkpoint's "
        "metadata or it was tampered with, so it was not loaded (nothing in it ran)"
    )


def load_metadata(file: Path) -> Metadata:
    """Unpickle DCP index ``file`` through the allow-list and check what it holds."""
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as exc:
        raise _refuse(file, f"names {exc.name}") from None
    except Exception as exc:  # garbled: only allow-listed constructors ran
        raise CheckpointError(
            f"cannot read the tensor index {file} ({type(exc).__name__}: "
            f"{one_line(str(exc), 150)}); the checkpoint is truncated or damaged, load an "
            "earlier one"
        ) from None
    if not isinstance(metadata, Metadata):
        raise _refuse(file, f"holds a {type(metadata).__name__}")
    storage = metadata.storage_data
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(storage, dict):
        raise _refuse(file, "holds a malformed index")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not _plain_name(name):
            raise _refuse(file, f"points at {name!r} (not a file of the checkpoint folder)")
    return metadata


def _plain_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
    )


class SafeReader(FileSystemReader):
    """``FileSystemReader`` that reads the index through the allow-list and only tensor items."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = load_metadata(Path(self.path) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:  # torch would unpickle it unrestricted
                raise _refuse(
                    Path(self.path) / METADATA_FILE, f"lists {item.dest_index.fqn!r} as bytes"
                )
        return super().read_data(plan, planner)


def read_dcp_metadata(path: Path) -> Metadata:
    """The DCP index of checkpoint folder ``path`` (reads no tensor, runs nothing)."""
    return SafeReader(path).read_metadata()
