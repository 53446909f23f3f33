"""DistributedOptimizer: each dp rank keeps fp32 master weights and state for its shard only."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mega_zero_optim.bucket import Bucket
from mega_zero_optim.clip import (
    clip_coefficient,
    global_grad_norm,
    raise_nonfinite,
)
from mega_zero_optim.ddp import DistributedDataParallel
from mega_zero_optim.flat_adamw import FlatAdamW, check_flat_fused, check_moment_dtype
from mega_zero_optim.host_update import (
    HostUpdate,
    ShardStep,
    optimizer_view,
    register_upload_hooks,
)
from mega_zero_optim.masters import (
    MasterPiece,
    MasterShard,
    build_pieces,
    flat_shards,
    prefixed_buffers,
)
from mega_zero_optim.memory import MemoryReport
from mega_zero_optim.offload import Offloader
from mega_zero_optim.scaler import DynamicLossScaler
from mega_zero_optim.sharded_bucket import ShardedBucket
from mega_zero_optim.state import (
    FORMAT,
    assemble_piece,
    check_shards,
    group_entries,
    piece_entry,
    restore_groups,
)

__all__ = ["DistributedOptimizer", "StepResult"]

#: Optimizers whose update is elementwise, so that it can run on any slice of a parameter.
SHARDABLE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.AdamW,
    torch.optim.Adam,
    torch.optim.SGD,
)


@dataclass(frozen=True)
class StepResult:
    """What one :meth:`DistributedOptimizer.step` did."""

    updated: bool
    """False when the step was skipped (non-finite gradients under a loss scaler)."""
    grad_norm: float
    """Global gradient 2-norm before clipping (after unscaling)."""
    loss_scale: float | None
    """The loss scale used for this step's gradients, or None without a scaler."""


def _low(grad: torch.Tensor) -> bool:
    return grad.dtype != torch.float32


class DistributedOptimizer:
    """ZeRO-1/2 over the buffers of one or more :class:`DistributedDataParallel` modules.

    ``optimizer`` is a torch.optim AdamW, Adam or SGD built over the wrapped modules'
    parameters (its param groups and hyperparameters are kept). It is taken over: its
    param groups are rewritten to hold fp32 master views of the pieces of each parameter
    inside this rank's shards, so its state exists only for those, and LR schedulers built on
    it keep working. :meth:`step` waits for the gradient reduction, unscales (fp16), computes
    the global gradient norm over ``grad_norm_group`` (default: the world; it must span
    every rank holding distinct gradients, dp and model-parallel), clips to
    ``max_grad_norm``, steps, writes the masters back to the parameters and all-gathers
    them over dp, either at once or, with ``overlap_param_gather``, overlapped with the next
    forward (each module waits for the buckets of its own parameters).

    ``optimizer_offload``: the fp32 masters, their gradients and the optimizer state live in
    host memory (pinned on CUDA) and the update runs on the CPU; each step copies the reduced
    gradient shards down and the updated parameter shards up on a side stream, shard by
    shard in the forward's order, each upload and all-gather overlapping the update of the
    next shard (see :mod:`mega_zero_optim.offload`). Give the optimizer ``fused=True`` for
    torch's one-pass multithreaded CPU kernel. The device then holds only the parameter and
    gradient buffers (:meth:`memory_report`: ``host_bytes``).

    ``overlap_host_update`` (with ``optimizer_offload``): :meth:`step` returns once the host
    updates are started on a background thread, and the next forward overlaps them: the
    pre-hook of the first module using a bucket waits for that shard's update, uploads it and
    launches its all-gather (so the gathers are overlapped with the forward at every stage, as
    with ``overlap_param_gather``; ZeRO-3's prefetch launches a gather only once its shard is
    updated). Collectives stay on the calling thread; see :mod:`mega_zero_optim.host_update`.
    Everything that reads or writes the masters, the optimizer state or the host gradients
    waits for the update first (the next :meth:`step`, :meth:`state_dict`,
    :meth:`load_state_dict`, :meth:`reload_model_params`, :meth:`memory_report`); call
    :meth:`wait` before reading the parameters outside a forward (or at the end of training).
    An update that fails raises its RuntimeError at the next wait.

    ``flat_fused`` (AdamW or Adam, on the device): each shard is stepped by one streaming
    pass per run of adjacent pieces in one param group, which also rounds the masters into
    the bf16/fp16 parameter shard (no separate write-back); the moments live in flat
    buffers, viewed by the optimizer's state, so state dicts are unchanged. A Triton kernel
    on CUDA, torch ops elsewhere (see :mod:`mega_zero_optim.flat_adamw`). Off by default
    here (the trainer turns it on for CUDA): on an H100 its kernel test passed and it took
    a compiled 1.3 B-parameter step from 278.1 to 272.5 ms (2026-12-07).

    ``moment_dtype``: Adam's moments in ``torch.float32`` or, with ``flat_fused``,
    ``torch.bfloat16`` (DeepSeek-V3's recipe: 4 bytes a parameter less; computed in fp32,
    stored rounded to nearest; state dicts carry bf16, and load converted either way).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        ddp: DistributedDataParallel | Sequence[DistributedDataParallel],
        *,
        max_grad_norm: float | None = None,
        grad_norm_group: ProcessGroup | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        overlap_param_gather: bool = False,
        optimizer_offload: bool = False,
        overlap_host_update: bool = False,
        flat_fused: bool = False,
        moment_dtype: torch.dtype = torch.float32,
    ) -> None:
        ddps = [ddp] if isinstance(ddp, DistributedDataParallel) else list(ddp)
        check_moment_dtype(
            moment_dtype,
            optimizer=optimizer,
            flat_fused=flat_fused,
            optimizer_offload=optimizer_offload,
        )
        if overlap_host_update and not optimizer_offload:
            raise ValueError(
                "overlap_host_update (True) overlaps the offloaded host update with the next "
                "forward, but optimizer_offload is False; pass optimizer_offload=True or leave "
                "overlap_host_update False"
            )
        if overlap_param_gather and any(d.sharding == "parameters" for d in ddps):
            raise ValueError(
                "overlap_param_gather does not apply to sharding='parameters' (each forward "
                "gathers the parameter shards it uses, prefetching ahead); leave it False"
            )
        if type(optimizer) not in SHARDABLE:
            raise ValueError(
                f"{type(optimizer).__name__} cannot be sharded by DistributedOptimizer (its update "
                "is not known to be elementwise); use torch.optim.AdamW, Adam or SGD"
            )
        if optimizer.state:
            raise ValueError(
                f"the optimizer already holds state for {len(optimizer.state)} parameters; wrap "
                "it in DistributedOptimizer before its first step"
            )
        if flat_fused:
            buffers = [b for d in ddps for b in d.param_and_grad_buffers]
            check_flat_fused(
                optimizer,
                param_dtypes=[b.param_dtype for b in buffers],
                grad_dtypes=[b.grad_dtype for b in buffers],
                optimizer_offload=optimizer_offload,
            )
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(
                f"max_grad_norm ({max_grad_norm}) must be positive; use None to disable clipping"
            )
        self.optimizer = optimizer
        # fused torch optimizers apply a grad_scale tensor inside their kernel
        self._fused = all(bool(g.get("fused")) for g in optimizer.param_groups)
        self.ddps = ddps
        self.max_grad_norm = max_grad_norm
        self.grad_norm_group = grad_norm_group
        self.loss_scaler = loss_scaler
        self.overlap_param_gather = overlap_param_gather
        self.num_steps = 0
        self._device = next((b.device for _, b in prefixed_buffers(ddps)), torch.device("cpu"))
        self._offloader = Offloader(self._device) if optimizer_offload else None
        self._host_update: HostUpdate | None = None
        if self._offloader is not None and overlap_host_update:
            self._host_update = HostUpdate(self._offloader)
        #: where the masters and the optimizer state live
        self._state_device = torch.device("cpu") if optimizer_offload else self._device
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._shards: list[MasterShard] = []
        pieces, self._master_bytes = build_pieces(
            ddps, grad_norm_group, self._offloader, shapes=self._shapes, shards=self._shards
        )
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in pieces:
                    raise ValueError(
                        f"the optimizer holds a parameter of shape {tuple(p.shape)} that no "
                        "wrapped module trains; build it from ddp.parameters()"
                    )
        self._group_names: list[list[str]] = []
        self._pieces: list[MasterPiece] = []
        for group in optimizer.param_groups:
            kept = [p for p in group["params"] if p.requires_grad]  # frozen: never stepped
            self._group_names.append([pieces[id(p)][0] for p in kept])
            mine = [piece for p in kept for piece in pieces[id(p)][1]]
            self._pieces += mine
            group["params"] = [piece.master for piece in mine]
        self._piece_of = {id(piece.master): piece for piece in self._pieces}
        self._flat = (
            FlatAdamW(optimizer, flat_shards(self._shards, self._pieces), moment_dtype)
            if flat_fused
            else None
        )
        # fp32 gradients are the masters' grads and bf16/fp16 ones are copied into fp32 each
        # step, except for the flat step, which reads these as they are and unscales as it reads
        self._raw = frozenset(id(p) for p in self._pieces if flat_fused and _low(p.grad))
        self._hook_handles: list[Any] = []
        if self._host_update is not None:
            self._arm_gates(self._host_update)

    # construction ------------------------------------------------------------------------

    def _arm_gates(self, host_update: HostUpdate) -> None:
        """overlap_host_update: every bucket's gather waits for its shard's upload; at dp 1
        (no gather) a forward pre-hook uploads the shards each module reads."""
        for shard in self._shards:
            shard.bucket.param_gate = host_update
        for ddp in self.ddps:
            if ddp.dp_size > 1:
                continue
            where: dict[int, list[Bucket | ShardedBucket]] = {}
            for buffer in ddp.param_and_grad_buffers:
                for p in buffer.params:
                    where[id(p)] = [buffer.buckets[b] for b in buffer.buckets_of[id(p)]]
            self._hook_handles += register_upload_hooks(ddp.module, where, host_update)

    # stepping ----------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups (set ``lr`` here or through a scheduler)."""
        return self.optimizer.param_groups

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the loss scale when there is a scaler."""
        return loss if self.loss_scaler is None else self.loss_scaler.scale_loss(loss)

    def zero_grad(self) -> None:
        """Zero the gradient buffers of every wrapped module (call before each step's backward).

        It does not wait for an overlapped host update: it touches only the device gradient
        buffers, not the host copies that update reads."""
        for ddp in self.ddps:
            ddp.zero_grad_buffer()

    @torch.no_grad()
    def step(self) -> StepResult:
        """Reduce gradients, check, clip, step this rank's shards, and share the new parameters
        (``overlap_host_update``: start the host update and return; see the class docstring)."""
        self.wait()  # the last step's host update reads the host gradients about to be written
        self.num_steps += 1
        for ddp in self.ddps:
            ddp.finish_param_sync()  # the last gather reads the shards about to be written
            ddp.finish_grad_sync()
        if self._offloader is not None:
            self._offloader.grads_down([s.host for s in self._shards if s.host is not None])
        for piece in self._pieces:
            if id(piece) not in self._raw:
                piece.master.grad = piece.grad.float() if _low(piece.grad) else piece.grad
        grads = [piece.master.grad for piece in self._pieces if piece.master.grad is not None]
        scale = None if self.loss_scaler is None else self.loss_scaler.scale
        if scale is not None:
            for g in grads:
                g.mul_(1.0 / scale)
        counted = [p.master.grad for p in self._pieces if p.counts and p.master.grad is not None]
        norm = float(
            global_grad_norm(
                counted,
                self.grad_norm_group,
                self._device,
                scaled=[p.grad for p in self._pieces if p.counts and id(p) in self._raw],
                unscale=1.0 if scale is None else 1.0 / scale,
            )
        )
        finite = math.isfinite(norm)
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf=not finite)
        if not finite:
            if self.loss_scaler is None:
                self._raise_nonfinite(norm)
            self._drop_grads()
            return StepResult(False, norm, scale)
        coefficient = 1.0
        if self.max_grad_norm is not None:
            coefficient = clip_coefficient(norm, self.max_grad_norm)
        if coefficient < 1.0 and self._flat is None and self._fused:
            # the fused kernel divides each gradient by grad_scale as it reads it: clipping
            # costs no extra pass over the gradients
            self.optimizer.grad_scale = torch.tensor(  # type: ignore[attr-defined]
                1.0 / coefficient, dtype=torch.float32, device=self._state_device
            )
        elif coefficient < 1.0 and self._flat is None:
            torch._foreach_mul_(grads, coefficient)
        try:
            if self._flat is not None:
                self._step_flat(self._flat, coefficient, scale)
            elif self._offloader is None:
                self.optimizer.step()
            else:
                self._step_offloaded(self._offloader)
        finally:
            if hasattr(self.optimizer, "grad_scale"):
                del self.optimizer.grad_scale
        if self._host_update is not None:  # the worker drops the gradients; gathers on use
            return StepResult(True, norm, scale)
        self._drop_grads()
        if self._offloader is None and self._flat is None:  # the flat step wrote them
            self._write_back()
        self._gather_params(wait=not self.overlap_param_gather)
        return StepResult(True, norm, scale)

    def _step_flat(self, flat: FlatAdamW, coefficient: float, scale: float | None) -> None:
        """Step every shard, the gradients multiplied as read: by the clip coefficient, and
        by 1/loss scale for bf16/fp16 gradient shards (the fp32 ones were unscaled in place
        above: their pieces' grads are views of them; the others' are copies)."""
        unscale = 1.0 if scale is None else 1.0 / scale
        low = [shard.grad.dtype != torch.float32 for shard in flat.shards]
        flat.step([coefficient * unscale if x else coefficient for x in low])

    def _write_back(self) -> None:
        """Copy the masters into the parameter shards (nothing for fp32 on the device)."""
        for shard in self._shards:
            if shard.master.data_ptr() != shard.bucket.param_shard.data_ptr():
                shard.bucket.param_shard.copy_(shard.master)

    def _shard_step(self, shard: MasterShard) -> ShardStep:
        """One shard's host update: a view of the optimizer over the shard's pieces."""
        view = optimizer_view(self.optimizer, shard.masters)
        assert shard.host is not None
        masters = [m for g in view.param_groups for m in g["params"]]
        return ShardStep(shard.bucket, shard.host, view, masters)

    def _step_offloaded(self, offloader: Offloader) -> None:
        """Step one shard at a time in the forward's order; each one's upload and
        all-gather are launched at once, overlapping the next shard's update
        (``overlap_host_update``: on the worker thread, gathers asked for now, launched on use)."""
        ordered = sorted(self._shards, key=lambda s: s.order)
        steps = [self._shard_step(shard) for shard in ordered]
        gathered_now = [
            s.bucket
            for s in ordered
            if s.bucket.dp_size > 1
            and not (isinstance(s.bucket, ShardedBucket) and s.bucket.shard_params)
        ]  # ZeRO-3 gathers on use
        if self._host_update is not None:
            self._host_update.begin(steps, gathered_now, self.num_steps)
            return
        launch = {id(b) for b in gathered_now}
        for shard, step in zip(ordered, steps, strict=True):
            step.run()
            offloader.params_up(step.host)
            if id(shard.bucket) in launch:
                shard.bucket.start_param_sync()

    def wait(self) -> None:
        """Return once the last step's update is done: masters and optimizer state final, every
        shard uploaded and, outside ZeRO-3, the parameters gathered. Nothing to wait for
        without ``overlap_host_update``; the RuntimeError of a failed host update otherwise."""
        if self._host_update is None or not self._host_update.active:
            return
        self._host_update.wait()
        for shard in self._shards:
            if not (isinstance(shard.bucket, ShardedBucket) and shard.bucket.shard_params):
                shard.bucket.finish_param_sync()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Copy the current parameters into the fp32 masters of this rank's shards.

        Call it after changing parameters outside the optimizer (loading model weights
        without an optimizer state); otherwise the next step writes the old masters back.
        fp32 parameters are their own masters and need nothing.
        """
        self.wait()
        if self._offloader is not None:
            self._offloader.wait()
        for shard in self._shards:
            if shard.master.data_ptr() != shard.bucket.param_shard.data_ptr():
                shard.master.copy_(shard.bucket.param_shard)

    def _drop_grads(self) -> None:
        for piece in self._pieces:
            piece.master.grad = None

    def _gather_params(self, *, wait: bool) -> None:
        for ddp in self.ddps:
            ddp.start_param_sync()
        if wait:
            for ddp in self.ddps:
                ddp.finish_param_sync()

    def _raise_nonfinite(self, norm: float) -> NoReturn:
        """Name the first parameter with a non-finite gradient, agreed on by every rank."""
        grads = [(p.name, p.grad) for p in self._pieces]  # as reduced (a flat step copies none)
        raise_nonfinite(grads, norm, self.num_steps, self.grad_norm_group)

    # state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: master values and optimizer state of the pieces it owns.

        Plain tensors and Python values only (save with ``torch.save``, load with
        ``weights_only=True``). Pieces are keyed by parameter name and range of the flattened
        parameter, so :meth:`load_state_dict` can re-shard them for any dp size. Waits for
        the host update in flight (``overlap_host_update``).
        """
        self.wait()
        for ddp in self.ddps:
            ddp.finish_param_sync()
        params: dict[str, dict[str, Any]] = {
            name: {"shape": list(shape), "pieces": []} for name, shape in self._shapes.items()
        }
        for piece in self._pieces:
            state = self.optimizer.state.get(piece.master, {})
            params[piece.name]["pieces"].append(piece_entry(piece.in_param, piece.master, state))
        groups = group_entries(self.optimizer.param_groups, self._group_names)
        first = self.ddps[0] if self.ddps else None
        return {
            "format": FORMAT,
            "optimizer": type(self.optimizer).__name__,
            "dp_size": 1 if first is None else first.dp_size,
            "dp_rank": 0 if first is None else dist.get_rank(first.dp_group),
            "num_steps": self.num_steps,
            "param_groups": groups,
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
            "params": params,
        }

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Load this rank's shard, or re-shard from the shards of every rank of another dp size.

        Pass the dict this rank saved (same dp size and model), or the list of dicts saved by
        all dp ranks of the old run (any dp size). Collective over dp: the parameters are
        set from the loaded master values and all-gathered.
        """
        shards = [state] if isinstance(state, Mapping) else list(state)
        check_shards(
            shards,
            optimizer_name=type(self.optimizer).__name__,
            num_groups=len(self.optimizer.param_groups),
            shapes=self._shapes,
        )
        self.wait()
        for ddp in self.ddps:
            ddp.finish_param_sync()
        if self._offloader is not None:
            self._offloader.wait()
        for group in self.optimizer.param_groups:
            on_device = bool(group.get("capturable") or group.get("fused"))
            for master in group["params"]:
                piece = self._piece_of[id(master)]
                values, piece_state = assemble_piece(
                    shards, piece.name, piece.in_param, master.device
                )
                master.copy_(values)
                for key, value in piece_state.items():  # torch keeps scalar steps on the CPU
                    if value.dim() == 0:
                        piece_state[key] = value.to(master.device if on_device else "cpu")
                    elif self._flat is None:  # torch's step: state in the master's dtype
                        piece_state[key] = value.to(master.device, master.dtype)
                self.optimizer.state[master] = piece_state
        restore_groups(self.optimizer.param_groups, self._group_names, shards[0]["param_groups"])
        if self._flat is not None:  # the loaded moments into the flat buffers
            self._flat.rebind()
        self.num_steps = int(shards[0]["num_steps"])
        if self.loss_scaler is not None and shards[0]["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(shards[0]["loss_scaler"])
        self._write_back()
        self._gather_params(wait=True)

    # memory ------------------------------------------------------------------------------

    def memory_report(self) -> MemoryReport:
        """Bytes per parameter this rank holds (the optimizer state exists after the first step)."""
        self.wait()
        buffers = [b for _, b in prefixed_buffers(self.ddps)]
        state_bytes = sum(
            v.numel() * v.element_size()
            for s in self.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        offloaded = self._offloader is not None
        host = sum(s.host.nbytes for s in self._shards if s.host is not None)
        return MemoryReport(
            num_params=sum(b.num_params for b in buffers),
            param_bytes=sum(b.param_bytes for b in buffers),
            grad_bytes=sum(b.grad_bytes for b in buffers),
            master_bytes=self._master_bytes,
            state_bytes=0 if offloaded else state_bytes,
            host_bytes=host + (state_bytes if offloaded else 0),
        )
