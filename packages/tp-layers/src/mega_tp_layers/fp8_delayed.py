"""Delayed FP8 scaling: a layer's scales from the amaxes of its earlier steps.

``Fp8Recipe(amax_history=n)`` (n > 0, tensor-wise scaling) quantises a linear layer's input
and output gradient with ``scale = fp8_max / max(amax over the last n steps)`` instead of
the amax of the tensor being quantised. The cast then waits on no reduction over that
tensor, so under ``torch.compile`` it can fuse into the kernel that produces the tensor
(the norm, SwiGLU, the residual's gradient); a value beyond the scaled range saturates at
the format's largest value, as in Transformer Engine's delayed scaling. The weight keeps
current scaling: no kernel produces it inside the step, and its amax is one read of a
tensor far smaller than the activations.

Each fp8 layer holds an :class:`Fp8AmaxHistory`:

- ``history`` ``[n, 2]`` fp32 (persistent: checkpoints carry it): row 0 the last step's
  amaxes, columns the input and the output gradient.
- ``current`` ``[2]``: this step's running max. The forward records ``|x|``'s max in module
  code (a buffer write that Dynamo functionalises). The backward's ``|dy|`` max leaves the
  linear's autograd Function as the gradient of ``probe``, a 0-d leaf that is not a
  parameter, and a post-accumulate hook folds it in and clears it (the autograd engine
  would sum it over micro-batches; the history needs their max).
- ``grad_unit``: how many times one process's output gradient this rank's is. A trainer
  that averages the loss over its rank's share of the batch and then the gradients over
  dp x cp replicas sees each output gradient dp x cp times one process's; the history
  stores one process's amaxes (a checkpoint resumes at any layout) and scales by
  ``grad_unit`` times them. Set it with :func:`set_fp8_grad_unit`.
- ``warm``: False until the first update. A cold step scales by the current amax (as
  ``Fp8Recipe(amax_history=0)`` does) and records it. The flag is a Python bool: compiled
  code recompiles once when it turns.

:func:`update_fp8_amax_histories` closes a step, after the backward of every micro-batch:
it stacks every layer's ``current``, all-reduces it (MAX) over the ranks that hold shards
or replicas of the same layers (tp x dp x cp), and pushes it into the histories. One
process's amax over the step's whole batch is the max of those local maxes, so every
layout scales as one process does. :func:`discard_fp8_amaxes` forgets a skipped step's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from mega_tp_layers._comm import all_reduce_max, group_size
from mega_tp_layers.fp8_recipe import check_amax_interval, check_amax_margin

if TYPE_CHECKING:
    from mega_tp_layers.fp8_recipe import Fp8Recipe

__all__ = [
    "Fp8AmaxHistory",
    "Fp8Delayed",
    "amax_history_for",
    "delayed_for",
    "discard_fp8_amaxes",
    "fp8_amax_histories",
    "opaque_amax",
    "recorded_amax",
    "refresh_fp8_amax_histories",
    "set_fp8_amax_recording",
    "set_fp8_grad_unit",
    "update_fp8_amax_histories",
]

#: Columns of ``history`` and ``current``.
INPUT, GRAD = 0, 1


@torch.library.custom_op("mega_tp_layers::abs_max", mutates_args=())
def _abs_max(t: Tensor) -> Tensor:
    # one reduction kernel, no |t| temporary; a max of bf16 values is exact in bf16
    amax: Tensor = torch.linalg.vector_norm(t, float("inf")).float()
    return amax


@_abs_max.register_fake
def _(t: Tensor) -> Tensor:
    return t.new_empty((), dtype=torch.float32)


def recorded_amax(t: Tensor) -> Tensor:
    """``|t|``'s max as a 0-d fp32 tensor (exact: a max rounds nothing), reduced over the
    last dim first, in ops ``torch.compile`` fuses into the kernel producing ``t`` (a
    norm's, SwiGLU's backward): the form delayed scaling records with. On one H100
    (2026-12-07, ``bench/RESULTS.md``) it ran the ``1b-bench`` step in 230.6 ms against
    238.4 ms for :func:`opaque_amax`, the reduction kept apart as its own kernel."""
    rows = t.detach().abs().amax(dim=-1) if t.dim() > 0 else t.detach().abs()
    return rows.amax().float()


def opaque_amax(t: Tensor) -> Tensor:
    """``|t|``'s max as :func:`recorded_amax` gives it, computed by an operator
    ``torch.compile`` cannot see into (one reduction kernel reading ``t`` once), for the
    A/B against the fused form (``bench/fp8_delayed_parts.py --part opaque-record``)."""
    amax: Tensor = _abs_max(t.detach())
    return amax


class Fp8Delayed(NamedTuple):
    """What a linear's autograd Function takes for delayed scaling."""

    amax: Tensor | None
    """``[2]`` fp32: the amaxes to scale the input and the output gradient by; None on a
    cold step (scale by the current amax)."""
    probe: Tensor | None
    """A 0-d fp32 leaf: the backward returns the local ``|dy|`` max as its gradient; None on
    a step that records nothing (``interval``)."""


class Fp8AmaxHistory(nn.Module):
    """The amax history of one fp8 linear layer (module doc)."""

    history: Tensor
    current: Tensor

    def __init__(
        self,
        length: int,
        device: torch.device | str | None = None,
        margin: int = 0,
        interval: int = 1,
    ) -> None:
        super().__init__()
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ValueError(f"Fp8AmaxHistory length ({length!r}) must be a positive integer")
        check_amax_margin("Fp8AmaxHistory margin", margin)
        check_amax_interval("Fp8AmaxHistory interval", interval)
        self.length = length
        self.margin = margin
        """Scales leave 2^margin of headroom: the amax they use is the history's x 2^margin."""
        self.interval = interval
        """Steps recorded: one in ``interval`` (see :func:`set_fp8_amax_recording`)."""
        self.recording = True
        """Whether this step records amaxes (a warm history only; a cold one always does)."""
        self.register_buffer("history", torch.zeros(length, 2, device=device))
        self.register_buffer("current", torch.zeros(2, device=device), persistent=False)
        self.warm = False
        self.grad_unit = 1.0
        self.probe = self._new_probe()

    def _new_probe(self) -> Tensor:
        probe = torch.zeros((), device=self.history.device, requires_grad=True)
        if probe.device.type != "meta":
            probe.register_post_accumulate_grad_hook(self._fold_grad_amax)  # type: ignore[no-untyped-call]
        return probe

    @torch.no_grad()
    def _fold_grad_amax(self, probe: Tensor) -> None:
        assert probe.grad is not None
        running = self.current[GRAD:]
        torch.maximum(running, probe.grad.reshape(1), out=running)  # one kernel a micro-batch
        probe.grad = None

    def for_forward(self, x: Tensor) -> Fp8Delayed:
        """Records ``x``'s amax (in training, with gradients on, on a recording step) and
        returns the scales, with the probe that records ``|dy|``'s (None when not recording)."""
        record = self.recording or not self.warm
        if record and self.training and torch.is_grad_enabled():
            amax = recorded_amax(x).reshape(1)
            self.current[INPUT:GRAD] = torch.maximum(self.current[INPUT:GRAD], amax)
        probe = self.probe if record else None
        if not self.warm:
            return Fp8Delayed(None, probe)
        amax = self.history.amax(dim=0)
        if self.margin:  # a power of two: exact
            amax = amax * float(2**self.margin)
        if self.grad_unit != 1.0:  # one process's gradient amax, in this rank's units
            amax = torch.stack([amax[INPUT], amax[GRAD] * self.grad_unit])
        return Fp8Delayed(amax, probe)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Any:
        fresh = self.history.device.type == "meta"
        result = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        with torch.no_grad():
            if self.history.dtype != torch.float32:  # amaxes stay fp32 under .to(bf16)
                self.history = self.history.float()
                self.current = self.current.float()
            if fresh and self.history.device.type != "meta":  # to_empty: start from zero
                self.history.zero_()
                self.current.zero_()
        if self.probe.device != self.history.device:
            self.probe = self._new_probe()
        return result

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["probe"]  # its hook is bound to this module: a copy makes its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self.probe = self._new_probe()

    def extra_repr(self) -> str:
        margin = f", margin={self.margin}" if self.margin else ""
        interval = f", interval={self.interval}" if self.interval != 1 else ""
        return (
            f"length={self.length}{margin}{interval}, warm={self.warm}, grad_unit={self.grad_unit}"
        )


def amax_history_for(
    fp8: Fp8Recipe | None, device: torch.device | str | None
) -> Fp8AmaxHistory | None:
    """A layer's amax history under a delayed-scaling recipe, else None."""
    if fp8 is None or not fp8.delayed:
        return None
    return Fp8AmaxHistory(
        fp8.amax_history, device=device, margin=fp8.amax_margin, interval=fp8.amax_interval
    )


def delayed_for(history: Fp8AmaxHistory | None, x: Tensor) -> Fp8Delayed | None:
    """The scales and probe of a layer's forward on ``x`` (recording its amax), if delayed."""
    return None if history is None else history.for_forward(x)


def fp8_amax_histories(modules: Iterable[nn.Module]) -> list[Fp8AmaxHistory]:
    """Every amax history inside ``modules``. The functions below take any modules; a
    trainer collects the histories once and passes this list, so that a step walks no
    module tree."""
    return [m for module in modules for m in module.modules() if isinstance(m, Fp8AmaxHistory)]


@torch.no_grad()
def update_fp8_amax_histories(
    modules: Iterable[nn.Module],
    group: ProcessGroup | None,
    overshoot: Tensor | None = None,
) -> int:
    """Closes a step: every layer's running max, maxed over ``group``, into its history.

    Call it once per optimizer step after the backward of every micro-batch, on every rank
    of ``group`` (the ranks holding the same layers: tp x dp x cp). Returns the number of
    histories updated. ``overshoot`` (a ``[2]`` fp32 tensor on the histories' device): maxed
    in place with this step's largest ratio, over the warm layers, of the step's amax to the
    amax its scales used (the history's max x 2^margin), for the inputs and the output
    gradients. Above 1, values beyond the scaled range saturated at the format's largest
    value in that step; no host read (the caller reads it when it logs).
    """
    # sorted by length (stable, so the same order on every rank): one row range per length;
    # the histories that recorded this step (set_fp8_amax_recording), the same on every rank
    recorded = [h for h in fp8_amax_histories(modules) if h.recording or not h.warm]
    histories = sorted(recorded, key=lambda h: h.length)
    if not histories:
        return 0
    current = torch.stack([h.current for h in histories])  # [layers, 2]
    if group is not None and group_size(group) > 1:
        all_reduce_max(current, group)
    units = {h.grad_unit for h in histories}
    if units != {1.0}:  # the gradient column in one process's units
        if len(units) == 1:
            current[:, GRAD] /= units.pop()
        else:
            for row, history in enumerate(histories):
                current[row, GRAD] /= history.grad_unit
    start, used = 0, []
    for _, same in itertools.groupby(histories, key=lambda h: h.length):
        buffers = [h.history for h in same]  # one length at once: a few kernels a step
        stop = start + len(buffers)
        stacked = torch.stack(buffers)  # [layers, n, 2], shifted down by one row
        if overshoot is not None:
            used.append(stacked.amax(dim=1))  # the amaxes this step's scales came from
        shifted = torch.cat([current[start:stop].unsqueeze(1), stacked[:, :-1]], dim=1)
        torch._foreach_copy_(buffers, list(shifted.unbind(0)))
        start = stop
    if overshoot is not None:
        _fold_overshoot(overshoot, current, torch.cat(used), histories)
    torch._foreach_zero_([h.current for h in histories])
    for history in histories:
        history.warm = True
    return len(histories)


def _fold_overshoot(
    overshoot: Tensor, current: Tensor, used: Tensor, histories: list[Fp8AmaxHistory]
) -> None:
    """``overshoot`` maxed with the step's largest ``current / (used x 2^margin)``; a cold
    history (all zeros: its step scaled by the current amax) counts as no overshoot."""
    margins = {h.margin for h in histories}
    if margins != {0}:
        if len(margins) == 1:
            used = used * float(2 ** margins.pop())
        else:
            factors = [float(2**h.margin) for h in histories]
            used = used * torch.tensor(factors, device=used.device).unsqueeze(1)
    ratio = torch.where(used > 0, current / used.clamp(min=1e-30), torch.zeros_like(used))
    torch.maximum(overshoot, ratio.amax(dim=0), out=overshoot)


@torch.no_grad()
def discard_fp8_amaxes(modules: Iterable[nn.Module]) -> None:
    """A skipped step (non-finite gradients): its running maxes are dropped, not pushed."""
    histories = fp8_amax_histories(modules)
    if histories:
        torch._foreach_zero_([h.current for h in histories])


def set_fp8_amax_recording(modules: Iterable[nn.Module], step: int) -> bool:
    """Before step ``step`` (0-based, counted over the whole run, so a resumed run records
    on the steps the straight run did): each history records amaxes on this step when
    ``step % interval == 0`` (a cold one always). Steps that record none run the casts with
    no reduction at all. Returns whether any history records."""
    any_records = False
    for history in fp8_amax_histories(modules):
        history.recording = step % history.interval == 0
        any_records |= history.recording or not history.warm
    return any_records


def set_fp8_grad_unit(modules: Iterable[nn.Module], unit: float) -> None:
    """Every history's ``grad_unit`` (module doc): this rank's output gradients are ``unit``
    times one process's. A trainer averaging over dp x cp replicas passes dp x cp."""
    if not isinstance(unit, int | float) or isinstance(unit, bool) or not unit > 0:
        raise ValueError(
            f"set_fp8_grad_unit: unit ({unit!r}) must be a positive number, the factor by "
            "which this rank's output gradients exceed one process's (1 for one process)"
        )
    for history in fp8_amax_histories(modules):
        history.grad_unit = float(unit)


def refresh_fp8_amax_histories(modules: Iterable[nn.Module]) -> None:
    """After loading histories into the buffers (a resume): a loaded, non-zero history is
    warm, so the next step scales from it as the saved run's next step would have. One host
    read for all of them; call it once after a load."""
    histories = fp8_amax_histories(modules)
    if histories:
        loaded = torch.stack([h.history.any() for h in histories]).tolist()
        for history, warm in zip(histories, loaded, strict=True):
            history.warm = bool(warm)
