"""A layer's fp8 weight kept across the micro-batches of one step.

With tensor-wise FP8 (``mega_tp_layers.fp8``) every forward quantises the weight: an amax
pass over the bf16 weight (all-reduced over tp when it is a shard), a second pass casting
it, ~5 bytes of memory traffic a parameter. Within one optimizer step the weight does not
change, so neither does its fp8 copy: ``Fp8Recipe(cache_weights=True)`` gives each fp8
linear an :class:`Fp8WeightCache` that the first forward after an invalidation fills and
every later forward (the step's other micro-batches, activation recomputation) reads. The
values are those a fresh quantisation would give, bit for bit. The cache keeps the weight
transposed too (``data_t``): the dgrad GEMM wants its second operand column-major and copied
it each micro-batch. The cost is two bytes a parameter held for the whole run (the backward
saved the fp8 weight of each micro-batch in flight anyway; with the cache they share one).

Whoever changes the weights invalidates the caches: :func:`invalidate_fp8_weight_caches`
after an optimizer step or a checkpoint load (the trainer calls it at the start of every
training and evaluation step, which covers both). ``valid`` is a Python bool, so compiled
code holds two variants of a layer, the filling one and the reading one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from mega_tp_layers.fp8_gemm import FP8_DTYPES, Fp8Tensor, fp8_quantize

if TYPE_CHECKING:
    from mega_tp_layers.fp8 import Fp8Recipe

__all__ = [
    "Fp8WeightCache",
    "WeightCache",
    "cached_fp8_weight",
    "fp8_weight_caches",
    "invalidate_fp8_weight_caches",
    "weight_cache_for",
]


class WeightCache(nn.Module):
    """Quantised copies of a weight, filled on the first forward after an invalidation.

    The base of every such cache (this module's tensor-wise one, mega-moe's row-wise expert
    weights), so :func:`invalidate_fp8_weight_caches` finds them all. A subclass registers
    its buffers with :meth:`_register_kept`, which keeps their dtypes through ``.to(dtype)``
    (that casts every floating buffer) and invalidates the cache on any move or cast.
    """

    def __init__(self) -> None:
        super().__init__()
        self.valid = False
        self._kept: dict[str, torch.dtype] = {}

    def _register_kept(self, name: str, t: Tensor) -> None:
        """A non-persistent buffer (a checkpoint holds the weight, not its copies) whose
        dtype survives ``.to(dtype)``."""
        self.register_buffer(name, t, persistent=False)
        self._kept[name] = t.dtype

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Any:
        result = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for name, dtype in self._kept.items():
            buf = getattr(self, name)
            if buf.dtype != dtype:
                setattr(self, name, torch.zeros(buf.shape, dtype=dtype, device=buf.device))
        self.valid = False  # moved, cast or materialised: filled again from the weight
        return result


class Fp8WeightCache(WeightCache):
    """One linear layer's weight (or weight shard) in fp8 with its inverse scale."""

    data: Tensor
    inv_scale: Tensor
    data_t: Tensor

    def __init__(
        self,
        shape: tuple[int, int],
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if dtype not in FP8_DTYPES:
            raise ValueError(
                f"Fp8WeightCache dtype ({dtype}) is not an fp8 format; use the recipe's "
                "fwd_dtype (torch.float8_e4m3fn or torch.float8_e5m2)"
            )
        self.fp8_dtype = dtype
        self._register_kept("data", torch.zeros(shape, dtype=dtype, device=device))
        # the same values transposed: the dgrad GEMM's column-major operand, made once a step
        rows, cols = shape
        self._register_kept("data_t", torch.zeros(cols, rows, dtype=dtype, device=device))
        self._register_kept("inv_scale", torch.ones((), device=device))

    def quantized(self, weight: Tensor, recipe: Fp8Recipe, group: ProcessGroup | None) -> Fp8Tensor:
        """``weight`` in ``recipe.fwd_dtype``, tensor-wise (amax over ``group`` for a shard):
        quantised and kept when the cache is not valid, read back when it is."""
        if tuple(weight.shape) != tuple(self.data.shape):
            raise ValueError(
                f"Fp8WeightCache holds a weight of shape {tuple(self.data.shape)}, got "
                f"{tuple(weight.shape)}; build the cache for the layer's own weight (shard)"
            )
        if not self.valid:
            fresh = fp8_quantize(weight, recipe.fwd_dtype, recipe.eps, group)
            with torch.no_grad():
                self.data.copy_(fresh.data)
                self.data_t.copy_(fresh.data.t())
                self.inv_scale.copy_(fresh.inv_scale)
            self.valid = True
        return Fp8Tensor(self.data, self.inv_scale, self.data_t.t())

    def extra_repr(self) -> str:
        shape = "x".join(str(d) for d in self.data.shape)
        return f"shape={shape}, dtype={self.fp8_dtype}, valid={self.valid}"


def weight_cache_for(
    fp8: Fp8Recipe | None, shape: tuple[int, int], device: torch.device | str | None
) -> Fp8WeightCache | None:
    """A layer's weight cache under a recipe with ``cache_weights``, else None."""
    if fp8 is None or not fp8.cache_weights:
        return None
    return Fp8WeightCache(shape, fp8.fwd_dtype, device)


def cached_fp8_weight(
    cache: Fp8WeightCache | None,
    weight: Tensor,
    recipe: Fp8Recipe | None,
    group: ProcessGroup | None = None,
) -> Fp8Tensor | None:
    """The fp8 weight a layer's GEMMs take from its cache, or None without a cache."""
    if cache is None or recipe is None:
        return None
    return cache.quantized(weight, recipe, group)


def fp8_weight_caches(modules: Iterable[nn.Module]) -> list[WeightCache]:
    """Every weight cache inside ``modules`` (a trainer collects them once)."""
    return [m for module in modules for m in module.modules() if isinstance(m, WeightCache)]


def invalidate_fp8_weight_caches(modules: Iterable[nn.Module]) -> None:
    """The weights changed (an optimizer step, a load): each cache fills again on its
    layer's next forward. Takes modules or the list :func:`fp8_weight_caches` returned."""
    for cache in fp8_weight_caches(modules):
        cache.valid = False
