"""DistributedDataParallel: gradients in contiguous buckets, reduced while backward still runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from mega_zero_optim.accumulate import accumulate_grad
from mega_zero_optim.bucket import Bucket, BucketState
from mega_zero_optim.buffer import ParamAndGradBuffer
from mega_zero_optim.ddp_checks import check_grad_reduction, check_replicate_group, check_sharding
from mega_zero_optim.gather import ParamGatherer, assign_units, forward_passes
from mega_zero_optim.sharded_bucket import ShardedBucket
from mega_zero_optim.sharded_buffer import ShardedBuffer
from mega_zero_optim.wgrad_fusion import offer_wgrad_fusion

__all__ = ["BucketInfo", "DistributedDataParallel"]

#: Default elements per bucket (as in Megatron-LM): large enough to reach full bandwidth.
DEFAULT_BUCKET_SIZE = 40_000_000

#: ZeRO-2/3: reduce-scatters in flight before a new one waits for the oldest, which bounds
#: the full gradients alive at once to this many buckets plus the one accumulating.
MAX_REDUCING = 2


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

    ``sharding`` picks what else each dp rank keeps only its shard of (with
    ``use_distributed_optimizer``, whose optimizer state is always sharded):

    - ``"optimizer"`` (ZeRO-1, the default): the layout above, gradient and parameter
      buffers whole on every rank.
    - ``"gradients"`` (ZeRO-2): buckets end at parameter boundaries and each owns its full
      gradients, allocated when its first gradient arrives and freed as soon as its
      reduce-scatter has finished (checked as later buckets launch theirs; at most
      ``MAX_REDUCING`` = 2 in flight, so at most three buckets' full gradients are alive); the reduced shard persists, ``numel/dp`` per rank.
      Gradient accumulation is the caller's choice: backward passes inside
      :meth:`no_sync` keep the bucket's full gradients until the synced backward (one
      reduce-scatter per step, a bucket's full gradients alive through the accumulation, as
      Megatron does), while backward passes outside it reduce-scatter every microbatch
      and add into the shard (one reduce-scatter per microbatch, full gradients alive only
      between a bucket's first gradient and its reduction: the least memory). Measured
      (8 linear layers of 64, one bucket each, fp32, dp 2, 4 microbatches): inside
      ``no_sync`` the gradient peak is 199,680 bytes (the shards plus every bucket's full
      gradients: 1.5x ZeRO-1's 133,120 buffer) with 8 reduce-scatters; outside it,
      116,480 bytes (the shards plus 3 buckets) with 32. Use no_sync for few, large
      microbatches when communication is the bottleneck, and the default otherwise.
    - ``"parameters"`` (ZeRO-3): also the parameters live as shards; each *gather unit*
      (``gather_units``; default: every submodule that directly holds trainable
      parameters; the wrapped module itself is the root unit, holding the rest) is
      all-gathered before its forward and again before its backward and freed after
      each; ``prefetch`` buckets ahead are gathered asynchronously (see
      :mod:`mega_zero_optim.gather`). The forward must go through this wrapper, and a
      module that reads another unit's parameter outside that unit's forward (a tied
      head) must list only units that do not, e.g. the transformer layers.
      :meth:`gathered_parameters` lends the full parameters for reading. A unit may be
      compiled (``unit.compile()``): its gather hooks run outside the graph.

    HSDP: with ``replicate_group`` the data-parallel ranks are ``dp_group`` (the shard group,
    over which every stage shards) times ``replicate_group`` (the ranks holding the same
    shard, e.g. ``groups.dp_shard`` and ``groups.dp_replicate`` of a
    ``ParallelConfig(dp_shard=...)``). Each bucket is reduce-scattered within the shard group,
    then its shard all-reduced across the replicas (the order with the least traffic across
    replicas, see :mod:`mega_zero_optim.hsdp`); gradients are averaged over both;
    parameters are gathered within the shard group only. ``dp_size`` is the shard group's
    size, ``replicate_size`` the replicas'; ``replicate_group=None`` is plain ZeRO.

    Every rank's backward must produce gradients for the same parameters (the
    collectives of the buckets are matched by order).

    ``wgrad_into_main_grad`` (ZeRO-1, fp32 gradients): a layer that marks a parameter
    ``mega_wgrad_fusion`` (mega-moe's grouped experts, mega-tp-layers' linears built with
    ``wgrad_fusion=True``) adds its weight gradient, times ``grad_scale``, into ``main_grad``
    inside its backward, and this wrapper skips its own add for it: the bf16 gradient is
    never written nor read again (Megatron's ``gradient_accumulation_fusion``). A parameter
    registered under two names (a tied weight) is never offered. False: every gradient goes
    through ``.grad``.
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
        sharding: str = "optimizer",
        gather_units: Sequence[nn.Module] | None = None,
        prefetch: int = 1,
        replicate_group: ProcessGroup | None = None,
        wgrad_into_main_grad: bool = True,
    ) -> None:
        super().__init__()
        check_replicate_group(dp_group, replicate_group)
        check_sharding(module, sharding, use_distributed_optimizer, gather_units, prefetch)
        check_grad_reduction(bucket_size, grad_reduce, grad_dtype, grad_scale)
        self.module = module
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.replicate_group = replicate_group
        self.replicate_size = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self._sync_enabled = True
        self.grad_scale = float(grad_scale)
        self.sharding = sharding
        self._gatherer: ParamGatherer | None = None
        self._in_flight: list[ShardedBucket] = []

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
        units: list[nn.Module] = []
        owner: dict[int, int] = {}
        sets: list[list[int]] = [[]]
        if sharding == "parameters":
            units = list(gather_units) if gather_units is not None else _default_units(module)
            sets, owner = assign_units(module, units, {id(p) for _, p in trainable})
            trainable.sort(key=lambda named: owner[id(named[1])])  # stable: a unit's together
        groups: dict[tuple[torch.dtype, torch.dtype], list[tuple[str, nn.Parameter]]] = {}
        for name, p in reversed(trainable):  # ~ the order backward produces gradients
            key = (p.dtype, p.dtype if grad_dtype is None else grad_dtype)
            groups.setdefault(key, []).append((name, p))
        self.param_and_grad_buffers: list[ParamAndGradBuffer | ShardedBuffer] = []
        for (_, gdt), named in groups.items():
            if sharding == "optimizer":
                self.param_and_grad_buffers.append(
                    ParamAndGradBuffer(
                        named,
                        grad_dtype=gdt,
                        bucket_size=bucket_size,
                        dp_group=dp_group,
                        reduce_scatter=use_distributed_optimizer,
                        average=grad_reduce == "mean",
                        replicate_group=replicate_group,
                    )
                )
                continue
            sharded = ShardedBuffer(
                named,
                [owner.get(id(p), 0) for _, p in named],
                grad_dtype=gdt,
                bucket_size=bucket_size,
                dp_group=dp_group,
                average=grad_reduce == "mean",
                shard_params=sharding == "parameters",
                replicate_group=replicate_group,
            )
            sharded.shard_and_free(
                dp_group, broadcast=broadcast_params, replicate_group=replicate_group
            )
            self.param_and_grad_buffers.append(sharded)
        self._handles: list[Any] = []
        self._fused_wgrad: set[int] = set()  # ids of params whose layer adds into main_grad
        shared = _shared_params(module)  # used by two modules: one may not fuse, so none does
        for buffer in self.param_and_grad_buffers:
            if broadcast_params and isinstance(buffer, ParamAndGradBuffer):
                buffer.broadcast_params(dp_group, replicate_group)
            for index, p in enumerate(buffer.params):
                offer = (
                    wgrad_into_main_grad
                    and isinstance(buffer, ParamAndGradBuffer)
                    and id(p) not in shared
                )
                if offer_wgrad_fusion(buffer, index, self.grad_scale, offer):
                    self._fused_wgrad.add(id(p))
                register = p.register_post_accumulate_grad_hook
                if isinstance(buffer, ShardedBuffer):
                    self._handles.append(register(self._sharded_grad_hook(buffer, index)))  # type: ignore[no-untyped-call]
                else:
                    self._handles.append(register(self._grad_hook(buffer, index)))  # type: ignore[no-untyped-call]
        if sharding == "parameters" and self.dp_size > 1:
            self._gatherer = self._build_gatherer(units, sets, owner, prefetch)
        elif self.dp_size > 1:
            self._register_param_sync_hooks()

    def _build_gatherer(
        self, units: list[nn.Module], sets: list[list[int]], owner: dict[int, int], prefetch: int
    ) -> ParamGatherer:
        bucket_of: dict[int, ShardedBucket] = {}
        for buffer in self.param_and_grad_buffers:
            assert isinstance(buffer, ShardedBuffer)
            for p in buffer.params:
                bucket_of[id(p)] = buffer.buckets[buffer.buckets_of[id(p)][0]]

        def unique(ids: list[int]) -> list[ShardedBucket]:
            found: dict[int, ShardedBucket] = {}
            for pid in ids:
                found.setdefault(id(bucket_of[pid]), bucket_of[pid])
            return sorted(found.values(), key=lambda b: (id(b.param_data.dtype), -b.index))

        owned = [unique([pid for pid in ids if owner[pid] == u]) for u, ids in enumerate(sets)]
        gatherer = ParamGatherer(units, [unique(ids) for ids in sets], owned, prefetch=prefetch)
        self._handles += gatherer.handles
        return gatherer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (each submodule first waits for its parameters' all-gather)."""
        if self._gatherer is not None:
            with self._gatherer.forward_pass():
                return self.module(*args, **kwargs)
        out = self.module(*args, **kwargs)
        self.finish_param_sync()  # modules this forward did not run
        return out

    @contextmanager
    def forward_context(self, *others: DistributedDataParallel) -> Iterator[None]:
        """What :meth:`forward` runs the module in, for a caller that calls a part of the
        wrapped module itself (a pipeline schedule calling one model chunk): under ZeRO-3
        the root unit gathered and the saved parameter views tracked for backward; nothing
        for the other stages. ``others``: more wrappers of the same module (e.g. its
        expert weights over another group), entered together."""
        gatherers = [d._gatherer for d in (self, *others) if d._gatherer is not None]
        if not gatherers:
            yield
            return
        with forward_passes(gatherers):
            yield

    # gradients ---------------------------------------------------------------------------

    def _grad_hook(self, buffer: ParamAndGradBuffer, index: int) -> Callable[[torch.Tensor], None]:
        main_grad = buffer.main_grads[index]
        buckets = [buffer.buckets[b] for b in buffer.buckets_of[id(buffer.params[index])]]
        name = buffer.names[index]
        fused = id(buffer.params[index]) in self._fused_wgrad

        def hook(param: torch.Tensor) -> None:
            for bucket in buckets:
                if bucket.state is not BucketState.ACCUMULATING:
                    raise RuntimeError(
                        f"the gradient of {name!r} arrived after its bucket was reduced; call "
                        "zero_grad_buffer() before each step's first backward and run all but "
                        "the last microbatch's backward inside no_sync()"
                    )
            if fused and param.grad is not None:  # the layer added it (see __init__)
                buffer.mark_holds_grad(index)
                param.grad = None
            elif param.grad is not None:  # the step's first need not read the zeros
                first = not buffer.holds_grad(index)
                accumulate_grad(main_grad, param.grad, alpha=self.grad_scale, first=first)
                buffer.mark_holds_grad(index)
                param.grad = None
            if self._sync_enabled and self.overlap_grad_reduce:
                for bucket in buckets:
                    if bucket.mark_ready(id(param)):
                        bucket.start_grad_sync()

        return hook

    def _sharded_grad_hook(
        self, buffer: ShardedBuffer, index: int
    ) -> Callable[[torch.Tensor], None]:
        main_grad = buffer.main_grads[index]
        bucket = buffer.buckets[buffer.buckets_of[id(buffer.params[index])][0]]

        def hook(param: torch.Tensor) -> None:
            bucket.open_grads()  # allocates the full gradients; a new microbatch reopens
            if param.grad is not None:
                accumulate_grad(main_grad, param.grad, alpha=self.grad_scale)
                param.grad = None
            if self._sync_enabled and self.overlap_grad_reduce and bucket.mark_ready(id(param)):
                bucket.start_grad_sync()
                self._in_flight.append(bucket)
                self._reap()
            if self._gatherer is not None:
                self._gatherer.grad_arrived(bucket, id(param))

        return hook

    def _reap(self) -> None:
        """Finish the reduce-scatters already done (their full gradients are freed now), and
        wait for the oldest while more than :data:`MAX_REDUCING` are in flight."""
        while len(self._in_flight) > MAX_REDUCING:
            self._in_flight.pop(0).finish_grad_sync()
        done = [b for b in self._in_flight if b.grad_sync_done]
        for bucket in done:
            bucket.finish_grad_sync()
        self._in_flight = [b for b in self._in_flight if b not in done]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients in backward passes run inside, without any collective."""
        before = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = before

    def _buckets(self) -> Iterator[Bucket | ShardedBucket]:
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
        self._in_flight = []
        if self._gatherer is not None:
            self._gatherer.free_all()

    def zero_grad_buffer(self) -> None:
        """Zero every gradient buffer and start a new step (waits for in-flight collectives)."""
        self._in_flight = []
        for buffer in self.param_and_grad_buffers:
            buffer.zero_grad()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers (the ``main_grad`` views) and ``.grad`` of other parameters."""
        self.zero_grad_buffer()
        super().zero_grad(set_to_none)

    # parameters --------------------------------------------------------------------------

    def _register_param_sync_hooks(self) -> None:
        where: dict[int, list[Bucket | ShardedBucket]] = {}
        for buffer in self.param_and_grad_buffers:
            for p in buffer.params:
                where[id(p)] = [buffer.buckets[b] for b in buffer.buckets_of[id(p)]]
        for sub in self.module.modules():
            buckets: dict[int, Bucket | ShardedBucket] = {}
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
        gathers overlap with the forward pass. With ``sharding="parameters"`` there is
        nothing to launch: each forward gathers what it uses.
        """
        if self.sharding == "parameters":
            return
        for buffer in self.param_and_grad_buffers:
            buckets: list[Bucket | ShardedBucket] = list(buffer.buckets)
            for bucket in reversed(buckets):
                bucket.start_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather in flight (ZeRO-3: and free what is gathered)."""
        if self._gatherer is not None:
            self._gatherer.free_all()
            return
        for bucket in self._buckets():
            bucket.finish_param_sync()

    @contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Inside, every parameter holds its full values (ZeRO-3 gathers them all; read only:
        the shards are not updated from them). Other stages hold them always."""
        if self._gatherer is None:
            yield
            return
        self._gatherer.gather_all()
        try:
            yield
        finally:
            self._gatherer.free_all()

    @contextmanager
    def trace_param_gathers(self) -> Iterator[list[tuple[str, int]]]:
        """Record ZeRO-3's ``("gather" | "use" | "free", bucket)`` events while inside.

        Buckets are numbered in their order of use in forward (the root unit's first).
        Empty for the other stages and at dp 1, where nothing is gathered.
        """
        log: list[tuple[str, int]] = []
        if self._gatherer is None:
            yield log
            return
        self._gatherer.log = log
        try:
            yield log
        finally:
            self._gatherer.log = None

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


def _default_units(module: nn.Module) -> list[nn.Module]:
    """Every submodule that directly holds a trainable parameter."""
    return [
        m
        for m in module.modules()
        if m is not module and any(p.requires_grad for p in m.parameters(recurse=False))
    ]


def _wait_for(buckets: list[Bucket | ShardedBucket]) -> Callable[[nn.Module, Any], None]:
    def hook(module: nn.Module, args: Any) -> None:
        for bucket in buckets:
            if bucket.param_sync_pending:
                bucket.finish_param_sync()

    return hook


def _shared_params(module: nn.Module) -> set[int]:
    """Ids of the parameters registered under more than one name (tied weights)."""
    seen: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, count in seen.items() if count > 1}
