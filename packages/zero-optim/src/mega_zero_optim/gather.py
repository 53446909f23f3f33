"""ZeRO-3's schedule: gather each unit's parameters before its forward and backward, free after.

A *gather unit* is a module whose parameters are all-gathered together: just before its
forward (a forward pre-hook), and freed after it (a forward hook). The wrapped module itself
is the root unit; it holds the parameters that lie in no other unit (an embedding, a final
norm, a head reading a tied weight), gathered for the whole forward and its backward. A
unit's parameters are those in its subtree outside any unit nested in it, so a unit may
read a parameter owned by another (a tied weight): it gathers that bucket too.

Backward: a tensor autograd saves in forward that is a view of a gathered bucket (a weight,
its transpose) is packed with its bucket (``torch.autograd.graph.saved_tensors_hooks``);
unpacking it in backward gathers the bucket again if it was freed, so every backward
node finds its parameters, in whatever order autograd runs them. A bucket is freed in
backward once every member's gradient has arrived. Prefetch: gathering bucket ``k``
launches the next ``prefetch`` buckets' all-gathers in the order of use (forward: the
units' registration order; backward: its reverse), so communication overlaps compute,
and at most ``1 + prefetch`` unit buckets (plus the root's) are gathered at once.

Activation recompute: a unit's forward run again inside backward (full-layer checkpointing)
gathers its buckets again but does not hold them (checkpointing may stop it before its
end); they are freed when their gradients arrive. The choice (reasoned, not timed):
gathering again costs one more all-gather per unit and step, while keeping the forward's
gathered parameters until backward would hold every unit at once and undo ZeRO-3's saving.

Compiled units (``unit.compile()``, the trainer's ``train.compile``): the forward hooks are
``torch.compiler.disable``-d, so dynamo leaves them out of the unit's graph and they run
eagerly around it, as FSDP2's hooks do under per-block compile; the graph sees ordinary,
gathered parameters and contains no collective or storage resize (measured: no graph
break, one forward and one backward graph for a stack of identical blocks). The
saved-tensor hooks stay the re-gather in backward: the compiled region's autograd node
saves its tensors eagerly at run time, through whatever pack hook is active (dynamo inlines
only hooks that are graph modules), so its saved parameter views are packed with their
buckets like eager ones. The alternatives, weighed: an autograd boundary at each unit's
output that gathers in backward would gather buckets no backward node reads (the first
unit's, when the input needs no gradient), and keeping a compiled unit's gathered
parameters from its forward to its backward would hold every unit at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from mega_zero_optim.sharded_bucket import ShardedBucket

__all__ = ["ParamGatherer", "assign_units", "forward_passes"]


def assign_units(
    module: nn.Module, units: Sequence[nn.Module], trainable: set[int]
) -> tuple[list[list[int]], dict[int, int]]:
    """For the root ``module`` (unit 0) and ``units`` (1..n): each unit's parameter ids, and
    the owner unit of every trainable parameter (the first unit listing it)."""
    nested: list[set[int]] = []  # ids of the modules in each unit's subtree
    all_units = [module, *units]
    for u in all_units:
        nested.append({id(m) for m in u.modules()})
    unit_ids = {id(u): i for i, u in enumerate(all_units)}
    sets: list[list[int]] = []
    for i, u in enumerate(all_units):
        inner = [j for j, v in enumerate(all_units) if j != i and id(v) in nested[i]]
        excluded = set().union(*(nested[j] for j in inner)) if inner else set()
        seen: list[int] = []
        for m in u.modules():
            if id(m) in excluded and unit_ids.get(id(m)) != i:
                continue
            for p in m.parameters(recurse=False):
                if id(p) in trainable and id(p) not in seen:
                    seen.append(id(p))
        sets.append(seen)
    owner: dict[int, int] = {}
    for i, ids in enumerate(sets):
        for pid in ids:
            owner.setdefault(pid, i)
    return sets, owner


def _in_backward() -> bool:
    """True while autograd runs a backward on this thread (a recomputed forward)."""
    return bool(torch._C._current_graph_task_id() != -1)


class ParamGatherer:
    """Hooks that gather and free the buckets of ZeRO-3 parameters around their use.

    ``sets[u]``: the buckets unit ``u`` reads (0: the root); ``owned[u]``: those it owns,
    in layout order. ``units[u - 1]`` is unit ``u``'s module.
    """

    def __init__(
        self,
        units: Sequence[nn.Module],
        sets: list[list[ShardedBucket]],
        owned: list[list[ShardedBucket]],
        *,
        prefetch: int,
    ) -> None:
        self.prefetch = prefetch
        self.sets = sets
        self.order: list[ShardedBucket] = [b for buckets in owned for b in buckets]
        self.position = {id(b): k for k, b in enumerate(self.order)}
        self.root = {id(b) for b in owned[0]}
        self._holders: dict[int, int] = {id(b): 0 for b in self.order}
        self._by_storage: dict[int, ShardedBucket] = {}
        self.log: list[tuple[str, int]] | None = None
        self.handles: list[Any] = []
        for u, unit in enumerate(units, start=1):
            self.handles.append(unit.register_forward_pre_hook(self._pre_hook(u)))
            self.handles.append(unit.register_forward_hook(self._post_hook(u)))

    # one bucket --------------------------------------------------------------------------

    def _record(self, event: str, bucket: ShardedBucket) -> None:
        if self.log is not None:
            self.log.append((event, self.position[id(bucket)]))

    def _start(self, bucket: ShardedBucket) -> None:
        if bucket.start_param_sync():
            self._by_storage[bucket.param_data.untyped_storage().data_ptr()] = bucket
            self._record("gather", bucket)

    def _use(self, bucket: ShardedBucket) -> None:
        self._start(bucket)
        bucket.finish_param_sync()
        self._record("use", bucket)

    def free(self, bucket: ShardedBucket) -> None:
        """Drop a bucket's full parameters (it is gathered again when next needed)."""
        ptr = bucket.param_data.untyped_storage().data_ptr()
        if bucket.free_params():
            self._by_storage.pop(ptr, None)
            self._record("free", bucket)

    def _prefetch_after(self, bucket: ShardedBucket, step: int) -> None:
        k = self.position[id(bucket)]
        for j in range(1, self.prefetch + 1):
            if 0 <= k + step * j < len(self.order):
                self._start(self.order[k + step * j])

    # forward -----------------------------------------------------------------------------

    def _acquire(self, u: int) -> None:
        # a forward recomputed in backward holds nothing: activation checkpointing may stop
        # it before its end (no forward hook then); its gradients free the buckets
        holds = not _in_backward()
        buckets = self.sets[u]
        for b in buckets:
            self._holders[id(b)] += holds
            self._start(b)
        if buckets:
            last = max(buckets, key=lambda b: self.position[id(b)])
            self._prefetch_after(last, +1)
        for b in buckets:
            self._use(b)
            if torch.is_grad_enabled():
                b.expect_backward()

    def _release(self, u: int) -> None:
        if _in_backward():  # a recomputed forward (see _acquire)
            return
        for b in self.sets[u]:
            self._holders[id(b)] -= 1
            if self._holders[id(b)] == 0 and id(b) not in self.root:
                self.free(b)

    # Compiled units (``module.compile()`` compiles ``_call_impl``, hooks included): the
    # hooks are left out of the graph (a graph break before and after the layer's body,
    # as FSDP2's hooks under ``torch._dynamo.config.skip_fsdp_hooks``), so collectives and
    # storage resizes run eagerly and the graph sees ordinary, gathered parameters.

    def _pre_hook(self, u: int) -> Any:
        @torch.compiler.disable  # type: ignore[untyped-decorator]
        def hook(module: nn.Module, args: Any) -> None:
            self._acquire(u)

        return hook

    def _post_hook(self, u: int) -> Any:
        @torch.compiler.disable  # type: ignore[untyped-decorator]
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._release(u)

        return hook

    @contextmanager
    def forward_pass(self, *, track: bool = True) -> Iterator[None]:
        """The root unit's forward: its buckets gathered, saved parameter views tracked
        (``track=False``: by the caller, see :func:`forward_passes`)."""
        self._acquire(0)
        try:
            if not track:
                yield
                return
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._release(0)
            if not torch.is_grad_enabled():  # no backward will need the root's parameters
                for b in self.sets[0]:
                    if self._holders[id(b)] == 0:
                        self.free(b)

    # backward ----------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        bucket = self._by_storage.get(t.untyped_storage().data_ptr()) if t.numel() else None
        return t if bucket is None else (bucket, t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, tuple):
            bucket, t = packed
            if not bucket.gathered or bucket.param_sync_pending:
                self._use(bucket)
            self._prefetch_after(bucket, -1)
            return t  # type: ignore[no-any-return]
        return packed  # type: ignore[no-any-return]

    def grad_arrived(self, bucket: ShardedBucket, param_id: int) -> None:
        """A member's gradient of this backward arrived: free the bucket after its last one."""
        if bucket.backward_ready(param_id) and self._holders[id(bucket)] == 0:
            self.free(bucket)

    def free_all(self) -> None:
        """Wait for every gather in flight and free every gathered bucket."""
        for b in self.order:
            if self._holders[id(b)] == 0:
                self.free(b)

    def gather_all(self) -> None:
        """Gather every bucket (for reading the full parameters)."""
        for b in self.order:
            self._start(b)
        for b in self.order:
            b.finish_param_sync()


@contextmanager
def forward_passes(gatherers: Sequence[ParamGatherer]) -> Iterator[None]:
    """The forward passes of several gatherers of one module at once (wrappers over
    different groups, e.g. dense and expert weights): torch keeps only the innermost pair
    of saved-tensor hooks, so one pair asks each gatherer in turn."""
    with ExitStack() as stack:
        for g in gatherers:
            stack.enter_context(g.forward_pass(track=False))

        def pack(t: torch.Tensor) -> Any:
            for i, g in enumerate(gatherers):
                packed = g._pack(t)
                if packed is not t:
                    return (i, packed)
            return t

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, tuple):
                return gatherers[packed[0]]._unpack(packed[1])
            return packed  # type: ignore[no-any-return]

        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
        yield
