"""Run a rank's plan: exchange tensors, then forward or backward one microbatch of one chunk.

An overlapped pair (a forward step followed by its backward step, named in ``pairs``) runs
as one compute step: through the chunks' :class:`~mega_pipeline.OverlappedForwardBackward`
hook when they all offer it, else as the forward and then the backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping, Sequence
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
from mega_pipeline.overlap import OverlappedForwardBackward
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
    if not isinstance(logs, Mapping):
        raise TypeError(
            f"loss_func returned (loss, {type(logs).__name__}); the values to log must be "
            "a dict {name: tensor}"
        )
    wrong = {str(k): type(v).__name__ for k, v in logs.items() if not isinstance(v, Tensor)}
    if wrong:
        raise TypeError(
            f"loss_func logged values that are not tensors ({wrong}); log each as a tensor, "
            "e.g. torch.tensor(value) or loss.detach()"
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
    records: dict[Key, Any]  # what overlap_record yielded, for the paired backwards


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
        paired_backwards: Collection[Key],
    ) -> None:
        self.paired_backwards = paired_backwards
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
        self.state = _State({}, {}, {}, {}, {}, {}, {})
        self.unposted: list[Step] = []  # the first exchanges of a unit, posted with its last
        self.pending: list[tuple[Any, ...]] = []  # exchanges posted, not yet waited for

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
        """Post the step's exchange. :meth:`finish_exchange` waits for it before the next
        F or B: the W passes run while it is in flight, and the exchanges of steps with no
        action (the first parts of a unit that moves two messages over one link) go out
        in one batch with the next pass's."""
        if not step.exchange.is_empty():
            self.unposted.append(step)
        if step.action is not None:
            self._post()

    def _post(self) -> None:
        steps, self.unposted = self.unposted, []
        if steps:
            self.pending += self._start(steps)

    def finish_exchange(self) -> None:
        """Complete every exchange posted and not yet waited for, in posting order."""
        self._post()
        pending, self.pending = self.pending, []
        for posted in pending:
            self._finish(posted)

    def _start(self, steps: Sequence[Step]) -> list[tuple[Any, ...]]:
        """Post the steps' exchanges as one batch."""
        assert self.comm is not None, "a plan with exchanges needs a communicator"
        s = self.state
        parts = []
        for step in steps:
            ex = step.exchange
            # a gradient has the shape of the activation it belongs to (kept when freed)
            back = ex.recv_next
            back_shape = (
                s.outputs[self._received(back)].shape
                if back is not None and back.kind == "gradient"
                else None
            )
            parts.append({
                "send_next": self._payload(ex.send_next),
                "send_prev": self._payload(ex.send_prev),
                "recv_prev": ex.recv_prev is not None,
                "recv_next": back is not None,
                "recv_next_shape": back_shape,
            })  # fmt: skip
        posted = self.comm.start_exchanges(parts)
        return [(p, step.exchange) for p, step in zip(posted, steps, strict=True)]

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

    def forward(
        self, action: Action, around: Callable[[Callable[[], Any]], Any] | None = None
    ) -> None:
        """One forward; ``around(run)`` (a pair's hook) calls ``run`` in its place."""
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
            iterator = self.data_iterators[action.chunk]
            module = self.chunks[action.chunk]
            with contextlib.ExitStack() as stack:
                if self.split_backward is not None and not self.forward_only:
                    # the backward of what runs inside leaves its weight gradients for W
                    s.weight_grads[key] = stack.enter_context(self.split_backward())
                if key in self.paired_backwards:
                    assert isinstance(module, OverlappedForwardBackward)
                    s.records[key] = stack.enter_context(module.overlap_record())
                if around is None:
                    result = self.forward_step(iterator, view)
                else:
                    result = around(lambda: self.forward_step(iterator, view))
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

    def _no_sync(self, chunk: int, last_of_chunk: bool) -> AbstractContextManager[Any]:
        no_sync = self.hooks.no_sync_func
        if no_sync is None or last_of_chunk:
            return contextlib.nullcontext()
        return no_sync(chunk)

    def backward(self, action: Action, last_of_chunk: bool) -> None:
        key = (action.microbatch, action.chunk)
        output, grad, input_tensor = self._take(key)
        with self._no_sync(action.chunk, last_of_chunk):
            backward_from(output, grad)
        self._input_grad(action, input_tensor)

    def pair(self, forward: Action, backward: Action, last_of_chunk: bool) -> None:
        """An overlapped pair as one compute step: through the forward chunk's hook."""
        key = (backward.microbatch, backward.chunk)
        output, grad, input_tensor = self._take(key)
        record = self.state.records.pop(key)
        module = self.chunks[forward.chunk]
        assert isinstance(module, OverlappedForwardBackward)

        def around(run: Callable[[], Any]) -> Any:
            return module.overlapped_forward_backward(run, record, output, grad)

        with self._no_sync(backward.chunk, last_of_chunk):
            self.forward(forward, around)
        self._input_grad(backward, input_tensor)

    def _take(self, key: Key) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """What a backward needs: the output, the gradient at it, the input (if any)."""
        s = self.state
        return s.outputs.pop(key), s.output_grads.pop(key, None), s.inputs.pop(key, None)

    def _input_grad(self, action: Action, input_tensor: Tensor | None) -> None:
        """Keep the backward's input gradient for the previous stage."""
        s = self.state
        key = (action.microbatch, action.chunk)
        stage = self._stage(action.chunk)
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
        with self._no_sync(action.chunk, last_of_chunk):
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
    pairs: Collection[int] = (),
    overlap: bool = True,
) -> list[dict[str, Tensor]]:
    """Follow ``steps`` on this rank; return the per-microbatch losses on the last stage.

    A plan with W actions needs ``split_backward``: each forward runs inside it and each W
    runs what it yielded. ``v_shape``: the two chunks form the V of ZBV/DualPipeV (chunk 1
    is virtual stage ``2 pp - 1 - pp_rank``; on the last rank chunk 0's output feeds
    chunk 1 directly).

    ``pairs``: indices of the steps whose forward forms an overlapped pair with the
    backward of the next step (whose exchange is empty). With ``overlap`` and every chunk
    an :class:`~mega_pipeline.OverlappedForwardBackward`, a pair runs through the hook;
    otherwise as its forward, then its backward.
    """
    has_w = any(step.action is not None and step.action.kind == "W" for step in steps)
    if has_w != (split_backward is not None and not forward_only):
        raise ValueError(
            "a plan with W actions needs split_backward, and split_backward needs W actions "
            f"(W actions: {has_w}, split_backward given: {split_backward is not None}); "
            "drop the W actions for a fused backward"
        )
    for i in pairs:
        f, b = steps[i].action, steps[i + 1].action if i + 1 < len(steps) else None
        if f is None or b is None or (f.kind, b.kind) != ("F", "B"):
            raise ValueError(f"step {i} ({f}) and the next ({b}) are not a forward and a backward")
        if not steps[i + 1].exchange.is_empty():
            raise ValueError(f"the backward {b} of the pair at step {i} has its own exchange")
    hooked = overlap and not forward_only and bool(pairs)
    hooked = hooked and all(isinstance(c, OverlappedForwardBackward) for c in chunks)
    paired = [steps[i + 1].action for i in pairs] if hooked else []
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
        paired_backwards={(a.microbatch, a.chunk) for a in paired if a is not None},
    )
    last, ends = _last_of_chunk(steps)
    for i, step in enumerate(steps):
        runner.exchange(step)
        action = step.action
        if action is None:
            continue
        if action.kind != "W":
            runner.finish_exchange()
        if hooked and i in pairs:
            backward = steps[i + 1].action
            assert backward is not None
            runner.pair(action, backward, last_of_chunk=i + 1 in last)
        elif hooked and i - 1 in pairs:
            pass  # the pair's backward ran with its forward
        elif action.kind == "F":
            runner.forward(action)
        elif action.kind == "B":
            runner.backward(action, last_of_chunk=i in last)
        else:
            runner.weight(action, last_of_chunk=i in last)
        if i in ends:
            runner.synced(ends[i])
    runner.finish_exchange()
    s = runner.state
    left = s.inputs or s.outputs or s.output_grads or s.input_grads or s.weight_grads
    assert not (left or s.records), "plan left tensors behind"
    return [s.losses[i] for i in sorted(s.losses)]
