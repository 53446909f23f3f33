"""Reading slices of tensors from a (sharded) safetensors checkpoint, opening only what is used."""

from __future__ import annotations

import json
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import Tensor

__all__ = ["SafetensorsReader"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SafetensorsReader:
    """Tensors of a Hugging Face model directory, by name, sliced without loading them whole.

    Uses ``model.safetensors.index.json`` when present (each shard file opened on first
    use), else ``model.safetensors``. Never reads pickle. Use as a context manager.
    """

    def __init__(self, hf_dir: str | Path) -> None:
        self.dir = Path(hf_dir)
        self._handles: dict[str, Any] = {}
        index = self.dir / INDEX
        if index.is_file():
            with index.open(encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no weight_map object; it is not a safetensors index")
            self.weight_map: dict[str, str] = {str(k): str(v) for k, v in weight_map.items()}
        elif (self.dir / SINGLE).is_file():
            self.weight_map = {name: SINGLE for name in self._open(SINGLE, "").keys()}
        else:
            pickled = sorted(p.name for p in self.dir.glob("*.bin"))
            hint = f" (it holds {', '.join(pickled)}: save it with safetensors)" if pickled else ""
            raise ValueError(
                f"{self.dir} holds neither {SINGLE} nor {INDEX}{hint}; pass a Hugging Face "
                "model directory saved with safetensors"
            )

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Release every open shard file."""
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def _open(self, file: str, tensor: str) -> Any:
        handle = self._handles.get(file)
        if handle is None:
            path = self.dir / file
            if not path.is_file():
                raise ValueError(
                    f"shard file {path} (holding {tensor or 'the weights'}) does not exist; "
                    "copy the complete checkpoint or fix its index"
                )
            from safetensors import safe_open  # optional dependency: mega-models[hf]

            opener: Any = safe_open
            handle = opener(str(path), framework="pt", device="cpu").__enter__()
            self._handles[file] = handle
        return handle

    def _slice(self, name: str) -> Any:
        file = self.weight_map.get(name)
        if file is None:
            raise ValueError(
                f"tensor {name} is not in the checkpoint {self.dir}; the checkpoint does not "
                "match its config.json"
            )
        handle = self._open(file, name)
        if name not in handle.keys():
            raise ValueError(
                f"tensor {name} is not in {self.dir / file} although the index names that file; "
                "the shard is stale or truncated"
            )
        return handle.get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of tensor ``name``."""
        return tuple(int(n) for n in self._slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...], dtype: torch.dtype) -> Tensor:
        """``full[index]`` of tensor ``name``, read from disk as only that slice, as ``dtype``."""
        piece: Tensor = self._slice(name)[index]
        return piece.to(dtype)

    def read_rows(self, name: str, start: int, stop: int, dtype: torch.dtype) -> Tensor:
        """Rows ``[start, stop)`` (dim 0) of tensor ``name``, all other dims whole."""
        ndim = len(self.shape(name))
        return self.read(name, (slice(start, stop),) + (slice(None),) * (ndim - 1), dtype)
