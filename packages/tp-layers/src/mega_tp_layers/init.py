"""Initialisation that gives the same full weights for any tensor-parallel size (rule 2).

Each parameter's FULL tensor is generated on the CPU in fp32 from a generator, then this
rank's shard is cut out and copied in. The generator is either seeded by
``(seed, parameter name)`` (:func:`param_generator`, used by :func:`init_parameters`) or
the default CPU generator, which every rank consumes identically when all ranks start
from the same seed. The init method of a parameter travels with it as ``param.mega_init``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from mega_tp_layers.shard import shard_spec, shard_tensor

__all__ = [
    "INIT_ATTR",
    "InitMethod",
    "Normal",
    "PaddedRows",
    "ScaledNormal",
    "Uniform",
    "XavierUniform",
    "Zeros",
    "init_full",
    "init_parameter",
    "init_parameters",
    "param_generator",
]

#: Name of the parameter attribute that holds its :class:`InitMethod`.
INIT_ATTR = "mega_init"


class InitMethod(Protocol):
    """Fills a full (unsharded) fp32 CPU tensor in place, drawing from ``generator``."""

    def __call__(self, full: Tensor, generator: torch.Generator) -> None: ...


@dataclass(frozen=True)
class Normal:
    """Normal(mean, std); Megatron's default for weights is std 0.02."""

    std: float = 0.02
    mean: float = 0.0

    def __call__(self, full: Tensor, generator: torch.Generator) -> None:
        nn.init.normal_(full, self.mean, self.std, generator=generator)


@dataclass(frozen=True)
class ScaledNormal:
    """Normal(0, std / sqrt(2 * num_layers)): output projections feeding the residual."""

    std: float
    num_layers: int

    def __call__(self, full: Tensor, generator: torch.Generator) -> None:
        nn.init.normal_(full, 0.0, self.std / math.sqrt(2.0 * self.num_layers), generator=generator)


@dataclass(frozen=True)
class Uniform:
    """Uniform(low, high)."""

    low: float
    high: float

    def __call__(self, full: Tensor, generator: torch.Generator) -> None:
        nn.init.uniform_(full, self.low, self.high, generator=generator)


@dataclass(frozen=True)
class XavierUniform:
    """Xavier/Glorot uniform, with fans taken from the FULL shape (so any tp agrees)."""

    gain: float = 1.0

    def __call__(self, full: Tensor, generator: torch.Generator) -> None:
        nn.init.xavier_uniform_(full, self.gain, generator=generator)


@dataclass(frozen=True)
class Zeros:
    """All zeros (biases); draws nothing from the generator."""

    def __call__(self, full: Tensor, generator: torch.Generator) -> None:
        full.zero_()


@dataclass(frozen=True)
class PaddedRows:
    """``inner`` on the first ``rows`` rows, zeros below: a padded vocabulary.

    The real rows are drawn exactly as an unpadded ``[rows, ...]`` tensor would be, so
    the weights of the real vocabulary do not depend on the padding (hence not on tp).
    """

    inner: InitMethod
    rows: int

    def __call__(self, full: Tensor, generator: torch.Generator) -> None:
        full.zero_()
        self.inner(full[: self.rows], generator)


def param_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded by ``(seed, name)``: stable across runs, processes, layouts."""
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return generator


def init_full(
    shape: tuple[int, ...], init_method: InitMethod, generator: torch.Generator
) -> Tensor:
    """The full fp32 CPU tensor ``init_method`` draws from ``generator``."""
    full = torch.empty(shape, dtype=torch.float32, device="cpu")
    init_method(full, generator)
    return full


def init_parameter(param: Tensor, generator: torch.Generator) -> bool:
    """Fill ``param`` with its shard of the full tensor its ``mega_init`` draws.

    Returns False (and leaves ``param`` alone) when it has no init method or lives on
    the meta device.
    """
    method = getattr(param, INIT_ATTR, None)
    if method is None or param.device.type == "meta":
        return False
    spec = shard_spec(param)
    full_shape = tuple(param.shape) if spec is None else spec.full_shape
    full = init_full(full_shape, method, generator)
    local = full if spec is None else shard_tensor(full, spec)
    with torch.no_grad():
        param.copy_(local)
    return True


def init_parameters(module: nn.Module, seed: int, *, prefix: str = "") -> list[str]:
    """(Re)initialise every parameter of ``module`` that carries an init method.

    Parameter ``name`` draws from ``param_generator(seed, prefix + name)``, so a model
    built at any tp size (or on the meta device and materialised with ``to_empty``) gets
    the same full weights. Returns the names it initialised.
    """
    done = []
    for name, param in module.named_parameters():
        if init_parameter(param, param_generator(seed, prefix + name)):
            done.append(prefix + name)
    return done
