"""Adam(W) over flat master shards, with the low-precision write-back in the same pass.

``DistributedOptimizer(flat_fused=True)`` steps its fp32 master shards here instead of
through the wrapped torch optimizer: each shard's moments live in two flat fp32 (or bf16) buffers,
and one launch per *segment* (a maximal run of adjacent pieces of one shard in one param
group, at one step count) reads the gradient, the master and both moments and writes the
master, the moments and the bf16/fp16 parameter shard. On the 1b-bench step torch's fused
AdamW (multi-tensor lists, ~2.2 TB/s on an H100) plus a separate write-back copy take
~19.8 ms; one streaming pass is predicted at ~14 ms. The kernel (``_adamw_triton``) has
not yet been timed on a GPU.

The torch optimizer stays the source of truth for everything else: its param groups give
the hyperparameters at every step (so LR schedules apply; its own ``step()`` is never
called, so its step hooks do not run and a torch LR scheduler warns once that it was
not), and its ``state`` holds, per
piece, ``step`` (a tensor, where torch keeps it) and ``exp_avg``/``exp_avg_sq`` as *views*
into the flat buffers, so a state dict has the format and values of a torch-stepped one.
A state loaded into the optimizer replaces those views; :meth:`FlatAdamW.rebind` copies
it into the flat buffers and points the state at them again.

On CUDA with triton the segment goes to the kernel; elsewhere (and for dtypes the kernel
does not take) to :func:`adamw_segment_torch`, the ops of torch's single-tensor Adam on
the flat views, so the host logic is the same everywhere.

``moment_dtype=torch.bfloat16`` (DeepSeek-V3's recipe, Megatron's
``--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``): the flat moment buffers are bf16. Each
step reads them widened to fp32, updates them and the master in fp32 exactly as with fp32
moments (the master's update uses the unrounded fp32 moments of this step), and stores
them rounded to nearest bf16: 4 bytes a parameter less state, and 8 of the kernel's 30
bytes moved an element less (22). The state's views, and so the state dicts, are bf16; a
state of the other dtype is converted as :meth:`FlatAdamW.rebind` copies it in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from mega_zero_optim.accumulate import _triton_enabled

__all__ = [
    "FlatAdamW",
    "FlatShard",
    "SegmentStep",
    "SegmentTensors",
    "adamw_segment_torch",
    "check_flat_fused",
    "check_moment_dtype",
    "step_segment",
]

_LOW = (torch.bfloat16, torch.float16)
_TAKEN = (torch.float32, *_LOW)
#: the dtypes the flat moment buffers may have
MOMENT_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class FlatShard:
    """One owned shard as the flat step sees it."""

    master: Tensor
    """[n] fp32 master values (the parameter shard itself for fp32 parameters)."""
    grad: Tensor
    """[n] the reduced gradient shard (fp32, bf16 or fp16)."""
    low_precision: Tensor | None
    """[n] the bf16/fp16 parameter shard the masters are rounded into; None for fp32."""
    pieces: tuple[Tensor, ...]
    """The masters of the pieces the optimizer steps: views into ``master``, any order."""


@dataclass(frozen=True)
class SegmentTensors:
    """One launch's 1-D views, of one length on one device."""

    grad: Tensor
    """fp32, bf16 or fp16; read only."""
    master: Tensor
    """fp32."""
    exp_avg: Tensor
    """fp32 or bf16 (computed in fp32, stored rounded to nearest)."""
    exp_avg_sq: Tensor
    """The dtype of ``exp_avg``."""
    low_precision: Tensor | None
    """bf16/fp16: receives the updated master rounded; None to write none."""


@dataclass(frozen=True)
class SegmentStep:
    """The scalars of one segment's step, read from its param group as torch's Adam does."""

    grad_mul: float
    """Multiplies the gradient as it is read (clipping; unscaling of low-precision grads)."""
    lr: float
    weight_decay: float
    decoupled: bool
    """AdamW's decay of the weights (True) or Adam's L2 term added to the gradient."""
    beta1: float
    beta2: float
    eps: float
    step: int
    """The step count after this step's increment (1 on the first step)."""

    @property
    def step_size(self) -> float:
        return self.lr / (1 - float(self.beta1 ** float(self.step)))

    @property
    def bias_correction2_sqrt(self) -> float:
        return float((1 - self.beta2 ** float(self.step)) ** 0.5)

    @classmethod
    def of_group(cls, group: dict[str, Any], grad_mul: float, step: int) -> SegmentStep:
        beta1, beta2 = group["betas"]
        return cls(
            grad_mul=grad_mul,
            lr=float(group["lr"]),
            weight_decay=float(group["weight_decay"]),
            decoupled=bool(group.get("decoupled_weight_decay", False)),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            step=step,
        )


def check_flat_fused(
    optimizer: torch.optim.Optimizer,
    *,
    param_dtypes: Sequence[torch.dtype],
    grad_dtypes: Sequence[torch.dtype],
    optimizer_offload: bool,
) -> None:
    """Raise ValueError, in one sentence, for what ``flat_fused=True`` does not implement."""
    kind = type(optimizer).__name__
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        raise ValueError(
            f"flat_fused (True) steps AdamW or Adam in one kernel, but the optimizer is {kind}; "
            "use torch.optim.AdamW or Adam, or leave flat_fused False"
        )
    for i, group in enumerate(optimizer.param_groups):
        for key in ("amsgrad", "maximize", "differentiable"):
            if group.get(key):
                raise ValueError(
                    f"flat_fused (True) does not implement {key} (param group {i} of the {kind} "
                    f"has {key}=True); set {key}=False or leave flat_fused False"
                )
    if optimizer_offload:
        raise ValueError(
            "flat_fused (True) steps the shards on the device, but optimizer_offload is True "
            "(with or without overlap_host_update); leave one of the two False"
        )
    for what, dtypes in (("parameter", param_dtypes), ("gradient", grad_dtypes)):
        for dtype in dtypes:
            if dtype not in _TAKEN:
                raise ValueError(
                    f"flat_fused (True) takes fp32, bf16 or fp16 {what} buffers, but one is "
                    f"{dtype}; train in one of those or leave flat_fused False"
                )


def check_moment_dtype(
    moment_dtype: torch.dtype,
    *,
    optimizer: torch.optim.Optimizer,
    flat_fused: bool,
    optimizer_offload: bool,
) -> None:
    """Raise ValueError, in one sentence, for moments in a dtype or a setting not implemented:
    bf16 moments are the flat step's (AdamW or Adam, on the device)."""
    if moment_dtype not in MOMENT_DTYPES:
        raise ValueError(
            f"moment_dtype ({moment_dtype}) must be torch.float32 or torch.bfloat16; pass one "
            "of those"
        )
    if moment_dtype == torch.float32:
        return
    kind = type(optimizer).__name__
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        raise ValueError(
            f"moment_dtype ({moment_dtype}) stores Adam's two moments, but the optimizer is "
            f"{kind}; use torch.optim.AdamW or Adam, or moment_dtype torch.float32"
        )
    if optimizer_offload:
        raise ValueError(
            f"moment_dtype ({moment_dtype}) keeps the moments in the flat step's device "
            "buffers, but optimizer_offload is True (the host update keeps fp32 state); "
            "leave optimizer_offload False or use moment_dtype torch.float32"
        )
    if not flat_fused:
        raise ValueError(
            f"moment_dtype ({moment_dtype}) keeps the moments in the flat step's buffers, but "
            "flat_fused is False; pass flat_fused=True or use moment_dtype torch.float32"
        )


def adamw_segment_torch(t: SegmentTensors, hp: SegmentStep) -> None:
    """One step of a segment with torch ops, in the order of torch's single-tensor Adam;
    bf16 moments are widened, updated in fp32 and copied back rounded to nearest."""
    g = t.grad.float() if hp.grad_mul == 1.0 else t.grad.float().mul(hp.grad_mul)
    if hp.weight_decay != 0:
        if hp.decoupled:
            t.master.mul_(1 - hp.lr * hp.weight_decay)
        else:
            g = g.add(t.master, alpha=hp.weight_decay)
    widened = t.exp_avg.dtype != torch.float32
    exp_avg = t.exp_avg.float() if widened else t.exp_avg  # a copy when widened
    exp_avg_sq = t.exp_avg_sq.float() if widened else t.exp_avg_sq
    exp_avg.lerp_(g, 1 - hp.beta1)
    exp_avg_sq.mul_(hp.beta2).addcmul_(g, g, value=1 - hp.beta2)
    denom = (exp_avg_sq.sqrt() / hp.bias_correction2_sqrt).add_(hp.eps)
    t.master.addcdiv_(exp_avg, denom, value=-hp.step_size)
    if widened:
        t.exp_avg.copy_(exp_avg)
        t.exp_avg_sq.copy_(exp_avg_sq)
    if t.low_precision is not None:
        t.low_precision.copy_(t.master)


def step_segment(t: SegmentTensors, hp: SegmentStep) -> None:
    """One step of a segment: the Triton kernel on CUDA (or in its interpreter on CPU with
    ``TRITON_INTERPRET=1``), :func:`adamw_segment_torch` otherwise."""
    if _kernel_applies(t):
        from mega_zero_optim._adamw_triton import adamw_segment

        adamw_segment(t, hp)
    else:
        adamw_segment_torch(t, hp)


def _kernel_applies(t: SegmentTensors) -> bool:
    return (
        _triton_enabled(t.master.device)
        and t.master.dtype == torch.float32
        and t.exp_avg.dtype in MOMENT_DTYPES
        and t.exp_avg_sq.dtype == t.exp_avg.dtype
        and t.grad.dtype in _TAKEN
        and (t.low_precision is None or t.low_precision.dtype in _LOW)
        and t.master.numel() > 0
    )


@dataclass
class _Segment:
    """Adjacent pieces of one shard in one param group at one step count: one launch."""

    shard: int
    start: int  # offsets in the shard
    end: int
    group: int
    steps: list[Tensor]  # the pieces' ``step`` tensors, incremented with ``count``
    count: int  # their step count, kept on the host (no device read per step)

    def continued_by(self, shard: int, start: int, group: int, count: int) -> bool:
        """Whether a piece at ``start`` of ``shard`` extends this segment's launch."""
        return (self.shard, self.end, self.group, self.count) == (shard, start, group, count)


class FlatAdamW:
    """Steps ``shards`` for ``optimizer`` (an AdamW or Adam over the shards' piece masters),
    the moments kept in ``moment_dtype`` (fp32 or bf16)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        shards: Sequence[FlatShard],
        moment_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.optimizer = optimizer
        self.shards = list(shards)
        self.moment_dtype = moment_dtype
        self._group_of = {
            id(m): i for i, group in enumerate(optimizer.param_groups) for m in group["params"]
        }
        #: per shard: the flat (exp_avg, exp_avg_sq) in ``moment_dtype``, allocated on the
        #: first step or load
        self.moments: list[tuple[Tensor, Tensor] | None] = [None] * len(self.shards)
        self._segments: list[_Segment] | None = None

    def rebind(self) -> None:
        """Take the state the optimizer now holds (a loaded one) into the flat buffers and
        point it at them again, converted to ``moment_dtype`` (fp32 moments rounded to
        nearest bf16, bf16 ones widened exactly); nothing before the first step or load
        gave any state."""
        self._segments = None
        if any(self.optimizer.state.get(m) for s in self.shards for m in s.pieces):
            self._bind()

    def step(self, grad_muls: Sequence[float]) -> None:
        """One step of every segment; ``grad_muls[i]`` multiplies shard ``i``'s gradient as
        it is read (the clip coefficient, and 1/loss scale where not unscaled already)."""
        if self._segments is None:
            self._bind()
        assert self._segments is not None
        steps = [t for seg in self._segments for t in seg.steps]
        if steps:
            torch._foreach_add_(steps, 1)
        # each group's hyperparameters read once a step (a tensor lr is read from the device)
        groups = [SegmentStep.of_group(g, 1.0, 0) for g in self.optimizer.param_groups]
        for seg in self._segments:
            seg.count += 1
            shard = self.shards[seg.shard]
            moments = self.moments[seg.shard]
            assert moments is not None
            cut = slice(seg.start, seg.end)
            low = shard.low_precision
            tensors = SegmentTensors(
                shard.grad[cut],
                shard.master[cut],
                moments[0][cut],
                moments[1][cut],
                None if low is None else low[cut],
            )
            step_segment(
                tensors, replace(groups[seg.group], grad_mul=grad_muls[seg.shard], step=seg.count)
            )

    def _bind(self) -> None:
        """Moments into the flat buffers (zeros for pieces without state, as torch starts
        them), views of them into the optimizer's state, and the segments."""
        segments: list[_Segment] = []
        for number, shard in enumerate(self.shards):
            moments = self.moments[number]
            if moments is None:
                moments = (
                    torch.zeros_like(shard.master, dtype=self.moment_dtype),
                    torch.zeros_like(shard.master, dtype=self.moment_dtype),
                )
                self.moments[number] = moments
            base = int(shard.master.storage_offset())
            for start, master in sorted(
                ((int(m.storage_offset()) - base, m) for m in shard.pieces), key=lambda x: x[0]
            ):
                end = start + master.numel()
                group = self._group_of[id(master)]
                step = self._bind_piece(master, moments, start, group)
                count = int(step)
                last = segments[-1] if segments else None
                if last is not None and last.continued_by(number, start, group, count):
                    last.end = end
                    last.steps.append(step)
                else:
                    segments.append(_Segment(number, start, end, group, [step], count))
        self._segments = segments

    def _bind_piece(
        self, master: Tensor, moments: tuple[Tensor, Tensor], start: int, group: int
    ) -> Tensor:
        """Point the piece's state at its part of the flat moments (copying what it held,
        in the buffer's dtype); its step tensor, created as torch would when it had none."""
        state = self.optimizer.state[master]
        for key, flat in zip(("exp_avg", "exp_avg_sq"), moments, strict=True):
            view = flat[start : start + master.numel()]
            if key in state:
                view.copy_(state[key].reshape(-1))
            else:
                view.zero_()
            state[key] = view
        if "step" not in state:
            state["step"] = _new_step(self.optimizer.param_groups[group], master.device)
        step: Tensor = state["step"]
        return step


def _new_step(group: dict[str, Any], device: torch.device) -> Tensor:
    """A step counter where torch's Adam would create it: on the device when ``fused`` or
    ``capturable``, else on the CPU."""
    if group.get("fused") or group.get("capturable"):
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.tensor(0.0, dtype=torch.float32)
