"""One optimizer step (or one evaluation) through the pipeline schedule, on one rank."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from mega_models import finalize_model_grads, gpt_forward_step
from mega_models.doc_mask import loss_mask
from mega_moe import MoELayer, update_expert_biases
from mega_parallel_grid import ProcessGroups
from mega_pipeline import (
    P2PCommunicator,
    broadcast_losses,
    forward_backward_dualpipev,
    forward_backward_zb_h1,
    forward_backward_zbv,
    get_forward_backward_func,
)
from mega_pretrain.build import Built
from mega_pretrain.phase_timer import PhaseTimer
from mega_tp_layers import (
    defer_weight_grads,
    discard_fp8_amaxes,
    fp8_amax_histories,
    fp8_weight_caches,
    invalidate_fp8_weight_caches,
    set_fp8_amax_recording,
    update_fp8_amax_histories,
)
from mega_zero_optim import StepResult

__all__ = ["Microbatch", "StepRunner"]

#: the module of Inductor's CUDA graph trees (train.compile_mode reduce-overhead)
_GRAPH_TREES = "torch._inductor.cudagraph_trees"

#: One micro-batch: ``(tokens, labels)``, each ``[micro_batch, seq_len]`` int64.
Microbatch = tuple[Tensor, Tensor]


def _untimed(_: str) -> AbstractContextManager[None]:
    return nullcontext()


class StepRunner:
    """Runs the forward-backward schedule over micro-batches and steps the optimizer.

    Every rank of a dp replica is given the same micro-batches (tp and cp ranks share a dp
    rank); under context parallelism each cp rank keeps its zig-zag share of every
    sequence. The loss of a micro-batch is the mean over its tokens; the schedule averages
    over micro-batches and the DDP over dp x cp, so the gradient is the mean over the
    global batch.

    MoE models: each micro-batch's loss also holds the router losses of the micro-batch,
    which enter backward inside the MoE layers (so every pipeline stage trains its own),
    weighted like the language-model loss; after each optimizer step the aux-loss-free
    expert biases move toward balance.

    Packed documents (``built.packing``): with ``eod_mask_loss`` the loss is the sum over the
    counted positions (inputs other than EOD) of the global batch divided by their number,
    counted over this dp rank's micro-batches and summed over dp before the schedule runs;
    each micro-batch carries the share ``count / (micro-batches * dp)``, so the schedule's
    mean over micro-batches and the DDP's over dp x cp give that mean at any layout.

    Multi-token prediction: each micro-batch's loss also holds its MTP term, which the
    model attaches to the main per-token loss (weighted like it); the returned loss stays
    the main language-model loss, and ``last_losses`` keeps the step's per-micro-batch
    records (``mtp_loss`` among them) for :func:`~mega_pretrain.mtp_logging.mtp_log_values`.
    """

    def __init__(
        self,
        built: Built,
        groups: ProcessGroups,
        *,
        seq_len: int,
        micro_batch_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        sequence_parallel: bool,
    ) -> None:
        self.built, self.groups, self.device = built, groups, device
        self.model = nn.ModuleList(built.chunks)
        self.moe_layers = [m for m in self.model.modules() if isinstance(m, MoELayer)]
        self.amax_histories = fp8_amax_histories(built.chunks)  # delayed fp8 scaling
        self.weight_caches = fp8_weight_caches(built.chunks)  # train.fp8_weight_cache
        # delayed scaling: the largest step-to-step growth of an amax over the scale's, per
        # log interval (fp8_log_values reads and resets it)
        self.fp8_overshoot = torch.zeros(2, device=device) if self.amax_histories else None
        self._calls = 0  # train_step calls: the step index when the caller gives none
        self.cp = groups.size("cp")
        self.last_losses: list[dict[str, Tensor]] = []
        self.packing = built.packing
        inner = gpt_forward_step(groups.cp, device, built.packing)

        def forward_step(data: Any, chunk: Any) -> Any:
            with built.forward_context():  # ZeRO-3: the root unit gathered, saved views tracked
                return inner(data, chunk)

        self._forward_step = forward_step
        self.pp = groups.size("pp")
        vpp = len(built.chunks) if len(built.chunks) > 1 else None
        self.schedule = get_forward_backward_func(self.pp, vpp)
        split = {"zb-h1": forward_backward_zb_h1, "zbv": forward_backward_zbv,
                 "dualpipev": forward_backward_dualpipev}.get(built.pp_schedule)  # fmt: skip
        if split is not None and self.pp > 1:  # the linears' W passes deferred
            self.schedule = partial(split, split_backward=defer_weight_grads)
        self.loss_rank = 0 if built.pp_schedule in ("zbv", "dualpipev") else None  # the V
        local = seq_len // self.cp
        if sequence_parallel:
            local //= groups.size("tp")
        self.communicator = (
            P2PCommunicator(
                groups.pp, tensor_shape=(local, micro_batch_size, hidden_size), dtype=dtype
            )
            if self.pp > 1
            else None
        )

    def _set_aux_loss_scale(self, num_microbatches: int) -> None:
        """The router losses' gradient: the language-model loss's weight in backward.

        The schedule divides each micro-batch's loss by their number, the loss scaler (fp16)
        multiplies it, and the DDP averages over dp x cp. The router losses of one rank are
        its shares of the loss over the tp x cp ranks of its micro-batch (summed over tp by
        the layer's own collectives, but averaged over cp by the DDP), hence the factor cp.
        """
        scaler = self.built.optimizer.loss_scaler
        scale = self.cp / num_microbatches * (1.0 if scaler is None else scaler.scale)
        for layer in self.moe_layers:
            layer.aux_loss_scale = scale

    def _run(self, batches: Sequence[Microbatch], forward_only: bool) -> Tensor:
        chunks = self.built.chunks
        ddps = self.built.ddps

        @contextmanager
        def no_sync_all() -> Iterator[None]:
            with ExitStack() as stack:
                # ZeRO-2/3 reduce-scatter every micro-batch into the shard (their full
                # gradients then live only until a bucket is reduced, not a whole step)
                for ddp in (d for d in ddps if d.sharding == "optimizer"):
                    stack.enter_context(ddp.no_sync())
                yield

        def no_sync(_: int) -> AbstractContextManager[None]:
            return no_sync_all()

        optimizer = self.built.optimizer
        if not forward_only:
            self._set_aux_loss_scale(len(batches))
        items = self._with_loss_counts(batches)
        losses = self.schedule(
            forward_step=self._forward_step,
            data_iterator=[iter(items) for _ in chunks],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(batches),
            communicator=self.communicator,
            forward_only=forward_only,
            no_sync_func=None if forward_only else no_sync,
            grad_scale_func=optimizer.scale_loss if optimizer.loss_scaler is not None else None,
        )
        losses = broadcast_losses(losses, self.groups.pp, device=self.device, src=self.loss_rank)
        self.last_losses = losses
        mean = torch.stack([d["loss"] for d in losses]).mean()
        if self.groups.size("dp_cp") > 1:  # the logged loss: mean over the global batch
            torch.distributed.all_reduce(mean, group=self.groups.dp_cp)
            mean /= self.groups.size("dp_cp")
        return mean

    def _with_loss_counts(self, batches: Sequence[Microbatch]) -> Sequence[tuple[Tensor, ...]]:
        """With ``eod_mask_loss``: each micro-batch with its share of the global batch's
        counted positions (see the class docstring); else the micro-batches as they are."""
        if self.packing is None or not self.packing.eod_mask_loss:
            return batches
        eod = self.packing.eod_id
        count = torch.stack([loss_mask(tokens, eod).sum() for tokens, _ in batches]).sum()
        count = count.to(self.device, torch.float64)
        if self.groups.size("dp") > 1:
            torch.distributed.all_reduce(count, group=self.groups.dp)
        share = count / (len(batches) * self.groups.size("dp"))
        return [(tokens, labels, share) for tokens, labels in batches]

    def train_step(
        self,
        batches: Sequence[Microbatch],
        lr: float,
        *,
        timer: PhaseTimer | None = None,
        step: int | None = None,
    ) -> tuple[Tensor, StepResult]:
        """Forward, backward and optimizer step; returns the mean loss (a device tensor).
        ``timer`` times the schedule as ``fwd_bwd`` and the rest (gradient sync, clip, step)
        as ``optim``. ``step``: this step's 0-based index in the run, which says whether
        delayed fp8 scaling records amaxes (``train.fp8_amax_interval``); None counts the
        calls of this runner."""
        phase = timer.phase if timer is not None else _untimed
        optimizer = self.built.optimizer
        for group in optimizer.param_groups:
            group["lr"] = lr
        # a new iteration for train.compile_mode 'reduce-overhead' (CUDA graph trees reuse what
        # the last step's backward freed). Only once Inductor recorded graphs (it imports the
        # graph trees then): importing them for nothing costs every run ~2 s of CPU.
        if _GRAPH_TREES in sys.modules:
            torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
        for ddp in self.built.ddps:
            ddp.zero_grad_buffer()
        for chunk in self.built.chunks:
            chunk.train()
        # the weights may have changed since the last forward (a step, a load): each layer's
        # first micro-batch quantises its weight again, the others read that fp8 copy
        invalidate_fp8_weight_caches(self.weight_caches)
        if self.amax_histories:  # delayed fp8 scaling: does this step record amaxes?
            set_fp8_amax_recording(self.amax_histories, self._calls if step is None else step)
        self._calls += 1
        with phase("fwd_bwd"):
            loss = self._run(batches, forward_only=False)
        with phase("optim"):
            for ddp in self.built.ddps:
                ddp.finish_grad_sync()
            finalize_model_grads(self.built.chunks, self.groups)
            result = optimizer.step()
            if self.amax_histories and result.updated:  # this step's amaxes, as one process's
                update_fp8_amax_histories(
                    self.amax_histories, self.groups.tp_dp_cp, overshoot=self.fp8_overshoot
                )
            elif self.amax_histories:
                discard_fp8_amaxes(self.amax_histories)
            if self.moe_layers:  # every tp x dp x cp replica of a router sees the same load
                update_expert_biases(self.model, self.groups.tp_dp_cp)
        return loss, result

    def fp8_log_values(self) -> dict[str, float]:
        """Delayed fp8 scaling's largest amax overshoot since the last call (one host read),
        for the inputs and the output gradients; {} without delayed scaling."""
        if self.fp8_overshoot is None:
            return {}
        values = self.fp8_overshoot.tolist()
        self.fp8_overshoot.zero_()
        return {"fp8_overshoot_input": values[0], "fp8_overshoot_grad": values[1]}

    @torch.no_grad()
    def discard_step(self) -> None:
        """After a skipped step (non-finite gradients): drop what its forwards counted
        toward the next expert-bias update, and the amaxes recorded for delayed fp8 scaling,
        as they drop their gradients."""
        discard_fp8_amaxes(self.amax_histories)
        for layer in self.moe_layers:
            load = getattr(layer.router, "load", None)
            if isinstance(load, Tensor):
                load.zero_()

    @torch.no_grad()
    def eval_step(self, batches: Sequence[Microbatch]) -> Tensor:
        """Mean loss over ``batches`` with no gradient and no update."""
        for chunk in self.built.chunks:
            chunk.eval()
        invalidate_fp8_weight_caches(self.weight_caches)  # the weights moved since: re-quantise
        return self._run(batches, forward_only=True)
