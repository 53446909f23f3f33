"""Optional NVIDIA Transformer Engine backend (FP8), behind the same layer constructors.

UNVERIFIED: written against Transformer Engine's documented PyTorch API
(``transformer_engine.pytorch.Linear`` with ``parallel_mode``, ``tp_group``,
``sequence_parallel``, ``return_bias``; ``fp8_autocast`` with a recipe from
``transformer_engine.common.recipe``) and never run: TE does not install on the machines
this package was developed on. Everything here imports TE lazily, on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed import ProcessGroup

__all__ = ["BACKENDS", "Backend", "check_backend", "fp8_autocast", "te_available", "te_linear"]

Backend = Literal["torch", "te"]
#: The values the layers' ``backend`` argument accepts.
BACKENDS: tuple[str, ...] = ("torch", "te")

_MISSING = (
    "backend='te' needs NVIDIA Transformer Engine, which is not installed; "
    "install transformer-engine[pytorch] on a CUDA machine or use backend='torch'"
)


def check_backend(backend: str) -> Backend:
    """Validate a ``backend`` argument, in one sentence."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    return "te" if backend == "te" else "torch"


def te_available() -> bool:
    """True when ``transformer_engine.pytorch`` can be imported."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def _te() -> ModuleType:
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except ImportError as exc:
        raise ImportError(_MISSING) from exc


def te_linear(
    in_features: int,
    out_features: int,
    *,
    parallel_mode: Literal["column", "row"],
    tp_group: ProcessGroup,
    tp_size: int,
    sequence_parallel: bool,
    bias: bool,
    return_bias: bool,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> nn.Module:
    """A ``transformer_engine.pytorch.Linear`` of FULL sizes ``in_features x out_features``.

    TE splits the weight itself (column: dim 0, row: dim 1), all-gathers the sequence
    before a column GEMM and reduce-scatters (or all-reduces) after a row GEMM. Its own
    initialisation is replaced by the caller's deterministic one.
    """
    te = _te()
    module: nn.Module = te.Linear(
        in_features,
        out_features,
        bias=bias,
        init_method=nn.init.zeros_,
        sequence_parallel=sequence_parallel,
        tp_group=tp_group,
        tp_size=tp_size,
        parallel_mode=parallel_mode,
        return_bias=return_bias,
        params_dtype=dtype if dtype is not None else torch.get_default_dtype(),
        device=device if device is not None else "cuda",
    )
    return module


def fp8_autocast(
    enabled: bool = True, recipe: Any = None, amax_group: ProcessGroup | None = None
) -> AbstractContextManager[Any]:
    """TE's FP8 region: run forward passes of ``backend="te"`` layers inside it.

    ``recipe`` defaults to ``transformer_engine.common.recipe.DelayedScaling()``;
    ``amax_group`` is the group FP8 scaling statistics are reduced over (usually tp x dp).
    """
    te = _te()
    if recipe is None:
        recipe = importlib.import_module("transformer_engine.common.recipe").DelayedScaling()
    context: AbstractContextManager[Any] = te.fp8_autocast(
        enabled=enabled, fp8_recipe=recipe, fp8_group=amax_group
    )
    return context
