"""Run a rank's plan: exchange tensors, then forward or backward one microbatch of one chunk."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mega_pipeline.chunk import (
    DataIterator,
    ForwardStep,
    LossOutput,
    SplitBackward,
    StageChunk,
    WeightGradPass,
)
from mega_pipeline.memory import backward_from, deallocate_output
from mega_pipeline.order import Action
from mega_pipeline.p2p import P2PCommunicator
from mega_pipeline.plan import Message, Step, virtual_stage
from mega_pipeline.zero_bubble import zbv_stage

__all__ = ["Hooks", "run_plan"]

Key = tuple[int, int]  # (microbatch, chunk)


@dataclass(frozen=True)
class Hooks:
    """Callbacks a data-parallel wrapper (or a loss scaler) hangs on the schedule."""

    grad_sync_func: Callable[[int], None] | None = None
    """Called with a chunk's index right after that chunk's last backward (and last W
    pass, in a split schedule) on this rank."""
    no_sync_func: Callable[[int], AbstractContextManager[Any]] | None = None
    """Context for every backward of a chunk except its last (gradient sync disabled);
    in a split schedule for every B and W pass but the chunk's last B and last W."""
    grad_scale_func: Callable[[Tensor], Tensor] | None = None
    """Scales the loss before backward (fp16 loss scaling); returned losses are unscaled."""


def _split_loss(result: LossOutput) -> tuple[Tensor, Mapping[str, Tensor]]:
    logs: Mapping[str, Tensor]
    if isinstance(result, Tensor):
        loss, logs = result, {}
    elif isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], Tensor):
        loss, logs = result
    else:
        raise TypeError(
            f"loss_func returned {type(result).__name__}; return a scalar loss tensor or "
            "(loss, {name: tensor}) for logging"
        )
    if loss.numel() != 1:
        raise ValueError(
            f"loss_func returned a loss of shape {tuple(loss.shape)}; return one scalar per "
            "microbatch (e.g. the mean over its tokens)"
        )
    return loss, logs


@dataclass
class _State:
    inputs: dict[Key, Tensor]
    outputs: dict[Key, Tensor]
    output_grads: dict[Key, Tensor]
    input_grads: dict[Key, Tensor]
    losses: dict[int, dict[str, Tensor]]
    weight_grads: dict[Key, WeightGradPass]


class _Runner:
    def __init__(
        self,
        *,
        forward_step: ForwardStep,
        chunks: Sequence[nn.Module],
        data_iterators: Sequence[DataIterator],
        communicator: P2PCommunicator | None,
        pp: int,
        pp_rank: int,
        num_microbatches: int,
        forward_only: bool,
        hooks: Hooks,
        split_backward: SplitBackward | None,
        v_shape: bool,
    ) -> None:
        self.split_backward = split_backward
        self.v_shape = v_shape
        self.forward_step = forward_step
        self.chunks = chunks
        self.data_iterators = data_iterators
        self.comm = communicator
        self.pp = pp
        self.pp_rank = pp_rank
        self.m = num_microbatches
        self.forward_only = forward_only
        self.hooks = hooks
        self.num_stages = pp * len(chunks)
        self.state = _State({}, {}, {}, {}, {}, {})
        self.pending: tuple[Any, ...] | None = None  # an exchange posted before W passes

    def _stage(self, chunk: int) -> int:
        if self.v_shape:
            return zbv_stage(self.pp, self.pp_rank, chunk)
        return virtual_stage(self.pp, self.pp_rank, chunk)

    def _chunk(self, stage: int) -> int:
        if self.v_shape:
            return int(stage >= self.pp)
        return stage // self.pp

    def _sent(self, message: Message) -> Key:
        """(microbatch, local chunk) of a message this rank sends."""
        return message.microbatch, self._chunk(message.src_stage)

    def _received(self, message: Message) -> Key:
        """(microbatch, local chunk) of a message this rank receives."""
        return message.microbatch, self._chunk(message.dst_stage)

    def _payload(self, message: Message | None) -> Tensor | None:
        if message is None:
            return None
        key = self._sent(message)
        if message.kind == "activation":
            return self.state.outputs[key]
        return self.state.input_grads.pop(key)

    def exchange(self, step: Step) -> None:
        """Run the step's exchange; before a W pass only post it (:meth:`finish_exchange`
        completes it before the next pass that is not a W), so the W runs meanwhile."""
        if step.exchange.is_empty():
            return
        self.finish_exchange()
        pending = self._start(step)
        if step.action is not None and step.action.kind == "W":
            self.pending = pending
        else:
            self._finish(pending)

    def finish_exchange(self) -> None:
        """Complete the exchange posted before the W passes, if any."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._finish(pending)

    def _start(self, step: Step) -> tuple[Any, ...]:
        ex = step.exchange
        assert self.comm is not None, "a plan with exchanges needs a communicator"
        s = self.state
        # a gradient has the shape of the activation it belongs to (kept when freed)
        back = ex.recv_next
        back_shape = (
            s.outputs[self._received(back)].shape
            if back is not None and back.kind == "gradient"
            else None
        )
        posted = self.comm.start_exchange(
            send_next=self._payload(ex.send_next),
            send_prev=self._payload(ex.send_prev),
            recv_prev=ex.recv_prev is not None,
            recv_next=back is not None,
            recv_next_shape=back_shape,
        )
        return posted, ex

    def _finish(self, pending: tuple[Any, ...]) -> None:
        posted, ex = pending
        s = self.state
        from_prev, from_next = posted.wait()
        for sent in (ex.send_next, ex.send_prev):
            if sent is None or sent.kind != "activation":
                continue
            out_key = self._sent(sent)
            if self.forward_only:
                del s.outputs[out_key]
            else:  # a view is swapped for a freed viewless alias: the view object is dropped
                s.outputs[out_key] = deallocate_output(s.outputs[out_key])
        for message, tensor in ((ex.recv_prev, from_prev), (ex.recv_next, from_next)):
            if message is None:
                continue
            assert tensor is not None
            key = self._received(message)
            if message.kind == "activation":
                s.inputs[key] = tensor.requires_grad_(not self.forward_only)
            else:
                s.output_grads[key] = tensor

    def forward(self, action: Action) -> None:
        s = self.state
        key = (action.microbatch, action.chunk)
        stage = self._stage(action.chunk)
        input_tensor = s.inputs.pop(key, None) if self.forward_only else s.inputs.get(key)
        assert (input_tensor is None) == (stage == 0), f"missing input for {action}"
        view = StageChunk(
            self.chunks[action.chunk],
            input_tensor,
            chunk=action.chunk,
            microbatch=action.microbatch,
            is_first_stage=stage == 0,
            is_last_stage=stage == self.num_stages - 1,
        )
        grad_mode = torch.no_grad() if self.forward_only else contextlib.nullcontext()
        with grad_mode:
            if self.split_backward is None or self.forward_only:
                result = self.forward_step(self.data_iterators[action.chunk], view)
            else:  # the backward of what runs inside leaves its weight gradients for W
                with self.split_backward() as weight_grads:
                    result = self.forward_step(self.data_iterators[action.chunk], view)
                s.weight_grads[key] = weight_grads
            if not (
                isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], Tensor)
            ):
                raise TypeError(
                    f"forward_step returned {type(result).__name__}; it must return "
                    "(output_tensor, loss_func)"
                )
            output, loss_func = result
            if stage < self.num_stages - 1:
                if not self.forward_only and not output.requires_grad:
                    raise ValueError(
                        f"pipeline stage {stage} (chunk {action.chunk}) returned an output "
                        "that does not require grad, so no gradient can flow back through it "
                        "(a first stage with no layers returns its input batch unchanged); "
                        "give that stage at least one layer with parameters"
                    )
                if self.v_shape and stage == self.pp - 1:  # the V turns: chunk 1 of this rank
                    turned = output.detach().requires_grad_(not self.forward_only)
                    s.inputs[(action.microbatch, 1)] = turned
                    if self.forward_only:
                        return
                s.outputs[key] = output
                return
            loss, logs = _split_loss(loss_func(output))
        record = {name: value.detach() for name, value in logs.items()}
        record.setdefault("loss", loss.detach())
        s.losses[action.microbatch] = record
        if not self.forward_only:
            scaled = loss / self.m
            if self.hooks.grad_scale_func is not None:
                scaled = self.hooks.grad_scale_func(scaled)
            s.outputs[key] = scaled

    def backward(self, action: Action, last_of_chunk: bool) -> None:
        s = self.state
        key = (action.microbatch, action.chunk)
        stage = self._stage(action.chunk)
        output = s.outputs.pop(key)
        grad = s.output_grads.pop(key, None)
        input_tensor = s.inputs.pop(key, None)
        no_sync = self.hooks.no_sync_func
        context = no_sync(action.chunk) if no_sync is not None and not last_of_chunk else None
        with context if context is not None else contextlib.nullcontext():
            backward_from(output, grad)
        if stage > 0:
            assert input_tensor is not None
            input_grad = input_tensor.grad
            if input_grad is None:
                input_grad = torch.zeros_like(input_tensor)
            if self.v_shape and stage == self.pp:  # back through the V's turn, on this rank
                s.output_grads[(action.microbatch, 0)] = input_grad
            else:
                s.input_grads[key] = input_grad

    def weight(self, action: Action, last_of_chunk: bool) -> None:
        """The W pass: the weight gradients the microbatch's backward left behind."""
        weight_grads = self.state.weight_grads.pop((action.microbatch, action.chunk))
        no_sync = self.hooks.no_sync_func
        context = no_sync(action.chunk) if no_sync is not None and not last_of_chunk else None
        with context if context is not None else contextlib.nullcontext():
            weight_grads.run()

    def synced(self, chunk: int) -> None:
        if self.hooks.grad_sync_func is not None:
            self.hooks.grad_sync_func(chunk)


def _last_of_chunk(steps: Sequence[Step]) -> tuple[set[int], dict[int, int]]:
    """Indices of the steps holding each chunk's last B and last W, and for each step that
    ends a chunk's gradients (the later of the two) the chunk."""
    last: dict[tuple[str, int], int] = {}
    for i, step in enumerate(steps):
        if step.action is not None and step.action.kind in ("B", "W"):
            last[(step.action.kind, step.action.chunk)] = i
    ends: dict[int, int] = {}
    for (_, chunk), i in last.items():
        ends[chunk] = max(ends.get(chunk, i), i)
    return set(last.values()), {i: chunk for chunk, i in ends.items()}


def run_plan(
    steps: Sequence[Step],
    *,
    forward_step: ForwardStep,
    chunks: Sequence[nn.Module],
    data_iterators: Sequence[DataIterator],
    communicator: P2PCommunicator | None,
    pp: int,
    pp_rank: int,
    num_microbatches: int,
    forward_only: bool,
    hooks: Hooks,
    split_backward: SplitBackward | None = None,
    v_shape: bool = False,
) -> list[dict[str, Tensor]]:
    """Follow ``steps`` on this rank; return the per-microbatch losses on the last stage.

    A plan with W actions needs ``split_backward``: each forward runs inside it and each W
    runs what it yielded. ``v_shape``: the two chunks form the V of ZBV/DualPipeV (chunk 1
    is virtual stage ``2 pp - 1 - pp_rank``; on the last rank chunk 0's output feeds
    chunk 1 directly).
    """
    has_w = any(step.action is not None and step.action.kind == "W" for step in steps)
    if has_w != (split_backward is not None and not forward_only):
        raise ValueError(
            "a plan with W actions needs split_backward, and split_backward needs W actions "
            f"(W actions: {has_w}, split_backward given: {split_backward is not None}); "
            "drop the W actions for a fused backward"
        )
    runner = _Runner(
        forward_step=forward_step,
        chunks=chunks,
        data_iterators=data_iterators,
        communicator=communicator,
        pp=pp,
        pp_rank=pp_rank,
        num_microbatches=num_microbatches,
        forward_only=forward_only,
        hooks=hooks,
        split_backward=split_backward,
        v_shape=v_shape,
    )
    last, ends = _last_of_chunk(steps)
    for i, step in enumerate(steps):
        runner.exchange(step)
        action = step.action
        if action is None or action.kind != "W":
            runner.finish_exchange()
        if action is None:
            continue
        if action.kind == "F":
            runner.forward(action)
        elif action.kind == "B":
            runner.backward(action, last_of_chunk=i in last)
        else:
            runner.weight(action, last_of_chunk=i in last)
        if i in ends:
            runner.synced(ends[i])
    runner.finish_exchange()
    s = runner.state
    assert not (s.inputs or s.outputs or s.output_grads or s.input_grads or s.weight_grads), (
        "plan left tensors behind"
    )
    return [s.losses[i] for i in sorted(s.losses)]
