"""What a user's ``forward_step`` receives and returns: the calling convention of every schedule."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeAlias

from torch import Tensor, nn

__all__ = [
    "DataIterator",
    "ForwardStep",
    "LossFunc",
    "LossOutput",
    "SplitBackward",
    "StageChunk",
    "WeightGradPass",
]

#: What ``loss_func`` returns: the microbatch's scalar loss, optionally with values to log.
LossOutput: TypeAlias = Tensor | tuple[Tensor, Mapping[str, Tensor]]

#: Turns the last stage's output into the microbatch's loss (a mean over the microbatch).
LossFunc: TypeAlias = Callable[[Tensor], LossOutput]

#: One chunk's source of microbatches; ``None`` where a stage reads no data.
DataIterator: TypeAlias = Iterator[Any] | None


class StageChunk:
    """A model chunk as ``forward_step`` sees it: call it like the chunk itself.

    On the first virtual stage the call goes to the chunk unchanged. On every other
    stage the activation received from the previous stage replaces the first positional
    argument (or becomes it, when none is given), so one ``forward_step`` serves every
    stage: ``output = model_chunk(batch_input, **extras)``. The attributes say where the
    call stands in the schedule.
    """

    __slots__ = ("chunk", "input_tensor", "is_first_stage", "is_last_stage", "microbatch", "module")

    def __init__(
        self,
        module: nn.Module,
        input_tensor: Tensor | None,
        *,
        chunk: int,
        microbatch: int,
        is_first_stage: bool,
        is_last_stage: bool,
    ) -> None:
        self.module = module
        """The chunk itself."""
        self.input_tensor = input_tensor
        """The activation received from the previous stage; ``None`` on the first stage."""
        self.chunk = chunk
        """Index of this chunk among the rank's chunks (0 unless interleaved)."""
        self.microbatch = microbatch
        """Index of the microbatch being computed."""
        self.is_first_stage = is_first_stage
        """True on the model's first virtual stage (the one that reads the input)."""
        self.is_last_stage = is_last_stage
        """True on the model's last virtual stage (whose output goes to ``loss_func``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.input_tensor is None:
            return self.module(*args, **kwargs)
        return self.module(self.input_tensor, *args[1:], **kwargs)

    def __repr__(self) -> str:
        return (
            f"StageChunk(chunk={self.chunk}, microbatch={self.microbatch}, "
            f"first={self.is_first_stage}, last={self.is_last_stage}, module={self.module!r})"
        )


#: ``forward_step(data_iterator, model_chunk) -> (output_tensor, loss_func)``.
ForwardStep: TypeAlias = Callable[[DataIterator, StageChunk], tuple[Tensor, LossFunc]]


class WeightGradPass(Protocol):
    """The weight gradients one forward's backward left for later (e.g. a
    ``mega_tp_layers.WeightGradStore``)."""

    def run(self) -> None:
        """Compute them and accumulate them into the parameters' gradients."""


#: Entered around a forward whose backward is to be split: what it yields is the W pass.
#: Zero-bubble schedules take one (``mega_tp_layers.defer_weight_grads``); layers that do
#: not split leave nothing in it, so their B pass stays B+W fused.
SplitBackward: TypeAlias = Callable[[], AbstractContextManager[WeightGradPass]]
