"""Module bases whose parameters keep their mega metadata through ``Module._apply``.

``Module.to_empty`` (meta -> real device), and ``.to`` where the tensor type changes,
replace parameter objects, which drops the attributes set on them. Every mega attribute
is named ``mega_*`` (``mega_shard``, ``mega_init``, ``mega_sequence_parallel``, mega-moe's
``mega_expert``): :class:`KeepsParamAttrs` puts them back on the new objects, for its own
parameters and its children's. :class:`ShardedModule` adds creating a parameter with its
shard spec and init method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from mega_tp_layers.grads import SEQUENCE_PARALLEL_ATTR
from mega_tp_layers.init import INIT_ATTR, InitMethod, init_parameter, param_generator
from mega_tp_layers.shard import SHARD_ATTR, ShardSpec, set_shard_spec

__all__ = [
    "PARAM_ATTR_PREFIX",
    "KeepsParamAttrs",
    "ShardedModule",
    "creation_generator",
    "param_attrs",
]

#: Every metadata attribute mega puts on a parameter starts with this.
PARAM_ATTR_PREFIX = "mega_"


def creation_generator(seed: int | None, name: str, param_name: str) -> torch.Generator:
    """The generator a parameter is drawn from at construction.

    With a seed: ``param_generator(seed, "<name>.<param_name>")``. Without: the default
    CPU generator, which gives tp-independent weights when every rank starts from the
    same torch seed and builds the same layers in the same order.
    """
    if seed is None:
        return torch.default_generator
    return param_generator(seed, f"{name}.{param_name}" if name else param_name)


def param_attrs(param: Tensor) -> dict[str, Any]:
    """The mega metadata attributes set on ``param`` (those named ``mega_*``), by name."""
    return {k: v for k, v in vars(param).items() if k.startswith(PARAM_ATTR_PREFIX)}


class KeepsParamAttrs(nn.Module):
    """A module whose parameters (its own and its children's) keep their ``mega_*``
    attributes when ``Module._apply`` (``to_empty``, ``.to``) replaces the objects."""

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Any:
        saved = {
            path: attrs
            for path, p in self.named_parameters(recurse=recurse, remove_duplicate=False)
            if (attrs := param_attrs(p))
        }
        result = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for path, attrs in saved.items():
            param = self.get_parameter(path)
            for key, value in attrs.items():
                setattr(param, key, value)
        return result


class ShardedModule(KeepsParamAttrs):
    """Base of the mega layers: parameters born with shard metadata and an init method."""

    def _make_param(
        self,
        name: str,
        spec: ShardSpec,
        init_method: InitMethod,
        *,
        generator: torch.Generator,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
        sequence_parallel: bool = False,
    ) -> nn.Parameter:
        param = nn.Parameter(torch.empty(spec.local_shape, dtype=dtype, device=device))
        self.register_parameter(name, param)
        self._adopt_param(
            name, spec, init_method, generator=generator, sequence_parallel=sequence_parallel
        )
        return param

    def _adopt_param(
        self,
        path: str,
        spec: ShardSpec,
        init_method: InitMethod,
        *,
        generator: torch.Generator,
        sequence_parallel: bool = False,
    ) -> None:
        """Give the parameter at ``path`` (own or a child's) its metadata, then initialise it."""
        param = self.get_parameter(path)
        set_shard_spec(param, spec)
        attrs: dict[str, Any] = {SHARD_ATTR: spec, INIT_ATTR: init_method}
        if sequence_parallel:
            attrs[SEQUENCE_PARALLEL_ATTR] = True
        for key, value in attrs.items():
            setattr(param, key, value)
        init_parameter(param, generator)
