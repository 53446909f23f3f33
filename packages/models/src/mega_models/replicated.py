"""A module base for parameters replicated over tp that keeps their metadata through ``to_empty``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from mega_tp_layers import INIT_ATTR, SEQUENCE_PARALLEL_ATTR, SHARD_ATTR

__all__ = ["KeepsParamAttrs"]

_ATTRS = (SHARD_ATTR, INIT_ATTR, SEQUENCE_PARALLEL_ATTR)


class KeepsParamAttrs(nn.Module):
    """``Module._apply`` (``to_empty``, ``.to``) may replace parameter objects; this puts the
    mega attributes (shard spec, init method, sequence-parallel mark) back on the new ones."""

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Any:
        saved = {
            name: {k: getattr(p, k) for k in _ATTRS if hasattr(p, k)}
            for name, p in self.named_parameters(recurse=False)
        }
        result = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for name, attrs in saved.items():
            param = getattr(self, name)
            for key, value in attrs.items():
                setattr(param, key, value)
        return result
