"""DistributedDataParallel: gradients in contiguous buckets, reduced while backward still runs."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from mega_zero_optim.bucket import Bucket, BucketState
from mega_zero_optim.buffer import ParamAndGradBuffer

__all__ = ["BucketInfo", "DistributedDataParallel"]

#: Default elements per bucket (as in Megatron-LM): large enough to reach full bandwidth.
DEFAULT_BUCKET_SIZE = 40_000_000


@dataclass(frozen=True)
class BucketInfo:
    """A snapshot of one bucket, for inspection."""

    buffer: int
    """Index of the buffer (one per parameter and gradient dtype pair)."""
    index: int
    """Index of the bucket in its buffer; bucket 0 is reduced first."""
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    start: int
    """First element of the bucket in its buffer."""
    end: int
    """One past the last element (padding included)."""
    params: tuple[str, ...]
    """Names of the parameters with elements in the bucket."""
    state: BucketState
    param_gather_pending: bool
    """True while the all-gather of its parameters is in flight (until a forward needs them)."""


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` for data parallelism over ``dp_group`` with bucketed, overlapped reduction.

    Every trainable parameter's data moves into one contiguous buffer per (param dtype,
    grad dtype), laid out in reverse order of registration, and its gradient accumulates
    into ``param.main_grad``, a view of a matching gradient buffer (``param.grad`` stays
    None). The buffers are cut into buckets of ``bucket_size`` elements; a parameter may
    straddle two buckets. When the last gradient of a bucket arrives during backward, the
    bucket's collective starts asynchronously (``overlap_grad_reduce``): a reduce-scatter
    when ``use_distributed_optimizer`` (each dp rank then holds the reduced gradients of its
    shard only, which is what :class:`DistributedOptimizer` reads), otherwise an all-reduce.
    :meth:`finish_grad_sync` waits for them all. Gradients are averaged over dp
    (``grad_reduce="mean"``, matching a mean loss over the global batch) or summed.

    Per step: ``zero_grad_buffer()``; every microbatch but the last under ``no_sync()``;
    backward of the last; then ``finish_grad_sync()`` (the distributed optimizer calls it).
    A parameter that gets no gradient in a step contributes zeros. Parameters are
    broadcast from dp rank 0 at construction so that all replicas start equal.

    ``param_filter(name, param)`` selects the parameters this wrapper owns (default: every
    trainable one), so that two wrappers of one module can reduce different parameters
    over different groups, e.g. mixture-of-experts weights over the expert data-parallel
    group and the rest over dp. ``grad_scale`` multiplies every gradient as it is
    accumulated, before the reduction (and before the ``1/dp`` of ``grad_reduce="mean"``):
    expert weights summed over a group smaller than dp use ``grad_reduce="sum"`` and
    ``grad_scale=1/dp``.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        dp_group: ProcessGroup,
        bucket_size: int | None = DEFAULT_BUCKET_SIZE,
        overlap_grad_reduce: bool = True,
        use_distributed_optimizer: bool = True,
        grad_dtype: torch.dtype | None = torch.float32,
        grad_reduce: str = "mean",
        broadcast_params: bool = True,
        param_filter: Callable[[str, nn.Parameter], bool] | None = None,
        grad_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if bucket_size is not None and (
            isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0
        ):
            raise ValueError(
                f"bucket_size ({bucket_size!r}) must be a positive number of elements; "
                "use None for one bucket per dtype"
            )
        if grad_reduce not in ("mean", "sum"):
            raise ValueError(
                f"grad_reduce ({grad_reduce!r}) must be 'mean' (average over dp) or 'sum'"
            )
        if grad_dtype is not None and not grad_dtype.is_floating_point:
            raise ValueError(
                f"grad_dtype ({grad_dtype}) must be a floating-point dtype, e.g. torch.float32, "
                "or None for each parameter's own dtype"
            )
        if (
            isinstance(grad_scale, bool)
            or not isinstance(grad_scale, (int, float))
            or not (grad_scale > 0 and math.isfinite(grad_scale))
        ):
            raise ValueError(
                f"grad_scale ({grad_scale!r}) must be a positive finite number; use 1.0 for none"
            )
        self.module = module
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self._sync_enabled = True
        self.grad_scale = float(grad_scale)

        trainable = [
            (n, p)
            for n, p in module.named_parameters()
            if p.requires_grad and (param_filter is None or param_filter(n, p))
        ]
        devices = sorted({str(p.device) for _, p in trainable})
        if len(devices) > 1:
            raise ValueError(
                f"the module's trainable parameters are on several devices ({', '.join(devices)}); "
                "move the module to one device before wrapping it"
            )
        groups: dict[tuple[torch.dtype, torch.dtype], list[tuple[str, nn.Parameter]]] = {}
        for name, p in reversed(trainable):  # ~ the order backward produces gradients
            key = (p.dtype, p.dtype if grad_dtype is None else grad_dtype)
            groups.setdefault(key, []).append((name, p))
        self.param_and_grad_buffers: list[ParamAndGradBuffer] = [
            ParamAndGradBuffer(
                named,
                grad_dtype=gdt,
                bucket_size=bucket_size,
                dp_group=dp_group,
                reduce_scatter=use_distributed_optimizer,
                average=grad_reduce == "mean",
            )
            for (_, gdt), named in groups.items()
        ]
        self._handles: list[Any] = []
        for buffer in self.param_and_grad_buffers:
            if broadcast_params:
                buffer.broadcast_params(dp_group)
            for index, p in enumerate(buffer.params):
                register = p.register_post_accumulate_grad_hook
                self._handles.append(register(self._grad_hook(buffer, index)))  # type: ignore[no-untyped-call]
        if self.dp_size > 1:
            self._register_param_sync_hooks()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (each submodule first waits for its parameters' all-gather)."""
        out = self.module(*args, **kwargs)
        self.finish_param_sync()  # modules this forward did not run
        return out

    # gradients ---------------------------------------------------------------------------

    def _grad_hook(self, buffer: ParamAndGradBuffer, index: int) -> Callable[[torch.Tensor], None]:
        main_grad = buffer.main_grads[index]
        buckets = [buffer.buckets[b] for b in buffer.buckets_of[id(buffer.params[index])]]
        name = buffer.names[index]

        def hook(param: torch.Tensor) -> None:
            for bucket in buckets:
                if bucket.state is not BucketState.ACCUMULATING:
                    raise RuntimeError(
                        f"the gradient of {name!r} arrived after its bucket was reduced; call "
                        "zero_grad_buffer() before each step's first backward and run all but "
                        "the last microbatch's backward inside no_sync()"
                    )
            if param.grad is not None:
                if self.grad_scale == 1.0 and not buffer.holds_grad(index):
                    main_grad.copy_(param.grad)  # the step's first: no need to read the zeros
                else:
                    main_grad.add_(param.grad, alpha=self.grad_scale)
                buffer.mark_holds_grad(index)
                param.grad = None
            if self._sync_enabled and self.overlap_grad_reduce:
                for bucket in buckets:
                    if bucket.mark_ready(id(param)):
                        bucket.start_grad_sync()

        return hook

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients in backward passes run inside, without any collective."""
        before = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = before

    def _buckets(self) -> Iterator[Bucket]:
        for buffer in self.param_and_grad_buffers:
            yield from buffer.buckets

    def start_grad_sync(self) -> None:
        """Launch the collective of every bucket not launched yet (asynchronously)."""
        for bucket in self._buckets():
            bucket.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Launch what backward has not launched, then wait for every gradient collective.

        Afterwards each rank's shard of every bucket holds the gradients reduced over dp
        (all of every bucket with ``use_distributed_optimizer=False``). Idempotent.
        """
        self.start_grad_sync()
        for bucket in self._buckets():
            bucket.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        """Zero every gradient buffer and start a new step (waits for in-flight collectives)."""
        for buffer in self.param_and_grad_buffers:
            buffer.zero_grad()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers (the ``main_grad`` views) and ``.grad`` of other parameters."""
        self.zero_grad_buffer()
        super().zero_grad(set_to_none)

    # parameters --------------------------------------------------------------------------

    def _register_param_sync_hooks(self) -> None:
        where: dict[int, list[Bucket]] = {}
        for buffer in self.param_and_grad_buffers:
            for p in buffer.params:
                where[id(p)] = [buffer.buckets[b] for b in buffer.buckets_of[id(p)]]
        for sub in self.module.modules():
            buckets: dict[int, Bucket] = {}
            for p in sub.parameters(recurse=False):
                buckets.update({id(b): b for b in where.get(id(p), [])})
            if buckets:
                self._handles.append(
                    sub.register_forward_pre_hook(_wait_for(list(buckets.values())))
                )

    def start_param_sync(self) -> None:
        """All-gather every bucket's parameters from the ranks owning them, asynchronously.

        Launched in order of use in forward (the reverse of the layout); a forward
        pre-hook on each module waits for the buckets holding its own parameters, so the
        gathers overlap with the forward pass.
        """
        for buffer in self.param_and_grad_buffers:
            for bucket in reversed(buffer.buckets):
                bucket.start_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather in flight."""
        for bucket in self._buckets():
            bucket.finish_param_sync()

    # inspection --------------------------------------------------------------------------

    def bucket_info(self) -> list[BucketInfo]:
        """One entry per bucket, in the order their collectives are launched."""
        infos = []
        for i, buffer in enumerate(self.param_and_grad_buffers):
            ids = {id(p): n for n, p in zip(buffer.names, buffer.params, strict=True)}
            for bucket in buffer.buckets:
                infos.append(
                    BucketInfo(
                        buffer=i,
                        index=bucket.index,
                        param_dtype=buffer.param_dtype,
                        grad_dtype=buffer.grad_dtype,
                        start=bucket.where.start,
                        end=bucket.where.end,
                        params=tuple(ids[pid] for pid in bucket.param_ids),
                        state=bucket.state,
                        param_gather_pending=bucket.param_sync_pending,
                    )
                )
        return infos


def _wait_for(buckets: list[Bucket]) -> Callable[[nn.Module, Any], None]:
    def hook(module: nn.Module, args: Any) -> None:
        for bucket in buckets:
            if bucket.param_sync_pending:
                bucket.finish_param_sync()

    return hook
