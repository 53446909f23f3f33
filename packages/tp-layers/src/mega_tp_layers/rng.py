"""Tracked RNG: named generator states to fork into for dropout inside the tp region.

Outside a fork, every rank of a tp group draws the same numbers (all ranks are seeded
alike), which is what replicated activations need. Inside ``tracker.fork("tp")`` each tp
rank draws from its own stream (seeded ``seed + 2718 + tp_rank``, as in Megatron), which
is what activations split over tp need (attention-probability dropout on a head slice).
Leaving the fork restores the device's generator exactly and keeps the named stream's
progress for the next fork. No global tracker: create one and pass it to the code that
needs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from mega_tp_layers._comm import group_rank

__all__ = ["TP_RNG", "TP_SEED_OFFSET", "RNGStatesTracker", "tp_rng_tracker"]

#: Name of the per-tp-rank state that :func:`tp_rng_tracker` adds.
TP_RNG = "tp"
#: Megatron's offset between the data-parallel seed and the tensor-parallel one.
TP_SEED_OFFSET = 2718


class RNGStatesTracker:
    """Named RNG states of one device type (``"cpu"`` or ``"cuda"``, the current GPU)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"RNGStatesTracker supports cpu and cuda devices, got {device}")
        self._states: dict[str, Tensor] = {}
        self._seeds: dict[str, int] = {}
        self._forked: list[str] = []

    def _generator(self) -> torch.Generator:
        if self.device.type == "cpu":
            return torch.default_generator
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the tracked states, in the order they were added."""
        return tuple(self._states)

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name`` seeded with ``seed``."""
        if name in self._states:
            raise ValueError(f"RNG state {name!r} is already tracked; pick another name")
        if seed in self._seeds.values():
            raise ValueError(f"seed {seed} already seeds another tracked RNG state; use another")
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        self._states[name] = generator.get_state()
        self._seeds[name] = seed

    @contextmanager
    def fork(self, name: str = TP_RNG) -> Iterator[None]:
        """Draw from state ``name`` inside the block; the device's own state is restored after."""
        if name not in self._states:
            known = ", ".join(self._states) or "none"
            raise ValueError(f"RNG state {name!r} is not tracked (tracked: {known}); add it first")
        if name in self._forked:
            raise ValueError(
                f"RNG state {name!r} is already forked; a nested fork of it would draw again "
                "the numbers the outer block drew, so draw inside the outer block instead"
            )
        generator = self._generator()
        outer = generator.get_state()
        generator.set_state(self._states[name])
        self._forked.append(name)
        try:
            yield
        finally:
            self._forked.remove(name)
            self._states[name] = generator.get_state()
            generator.set_state(outer)

    def state_dict(self) -> dict[str, Tensor]:
        """Every tracked state (clone), e.g. to save in a checkpoint or replay a recompute."""
        return {name: state.clone() for name, state in self._states.items()}

    def load_state_dict(self, states: dict[str, Tensor]) -> None:
        """Replace the tracked states by ``states`` (as given by :meth:`state_dict`)."""
        unknown = sorted(set(states) - set(self._states))
        if unknown:
            raise ValueError(f"RNG states {unknown} are not tracked; add them before loading")
        for name, state in states.items():
            self._states[name] = state.clone()


def tp_rng_tracker(
    seed: int, tp_group: ProcessGroup, device: torch.device | str = "cpu"
) -> RNGStatesTracker:
    """A tracker with state ``"tp"`` seeded ``seed + 2718 + tp_rank`` (Megatron's rule)."""
    tracker = RNGStatesTracker(device)
    tracker.add(TP_RNG, seed + TP_SEED_OFFSET + group_rank(tp_group))
    return tracker
