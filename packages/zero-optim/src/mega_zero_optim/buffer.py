"""Contiguous parameter and gradient buffers for the parameters of one dtype, cut into buckets."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from mega_zero_optim.bucket import Bucket
from mega_zero_optim.hsdp import broadcast_from_first
from mega_zero_optim.shard_range import Range, bucket_ranges, pack

__all__ = ["ParamAndGradBuffer"]


class ParamAndGradBuffer:
    """One flat parameter buffer and one flat gradient buffer, with the same layout.

    ``params`` come in packing order (the DDP wrapper passes them in reverse order of
    registration, roughly the order backward produces their gradients). Each parameter's
    ``.data`` becomes a view into :attr:`param_data`, and its ``main_grad`` attribute a view
    into :attr:`grad_data`, where backward accumulates its gradient.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        *,
        grad_dtype: torch.dtype,
        bucket_size: int | None,
        dp_group: ProcessGroup,
        reduce_scatter: bool,
        average: bool,
        replicate_group: ProcessGroup | None = None,
    ) -> None:
        assert named_params, "a buffer needs at least one parameter"
        first = named_params[0][1]
        self.param_dtype = first.dtype
        self.grad_dtype = grad_dtype
        self.device = first.device
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.ranges: list[Range] = pack([p.numel() for p in self.params])
        dp = dist.get_world_size(dp_group)
        cuts = bucket_ranges(self.ranges[-1].end, bucket_size, dp)
        numel = cuts[-1].end
        self.param_data = torch.zeros(numel, dtype=self.param_dtype, device=self.device)
        self.grad_data = torch.zeros(numel, dtype=grad_dtype, device=self.device)
        self._holding: set[int] = set()  # indices whose view got a gradient this step
        self.main_grads: list[torch.Tensor] = []
        for p, r in zip(self.params, self.ranges, strict=True):
            view = self.param_data[r.start : r.end].view(p.shape)
            view.copy_(p.data)
            p.data = view
            main_grad = self.grad_data[r.start : r.end].view(p.shape)
            p.main_grad = main_grad  # type: ignore[attr-defined]
            self.main_grads.append(main_grad)
        ids = [id(p) for p in self.params]
        self.buckets: list[Bucket] = []
        #: id(param) -> indices of the buckets it lies in (more than one when it straddles)
        self.buckets_of: dict[int, list[int]] = {i: [] for i in ids}
        for b, where in enumerate(cuts):
            inside = [ids[i] for i, r in enumerate(self.ranges) if r.intersect(where)]
            for i in inside:
                self.buckets_of[i].append(b)
            self.buckets.append(
                Bucket(
                    b,
                    where,
                    inside,
                    self.param_data,
                    self.grad_data,
                    dp_group=dp_group,
                    reduce_scatter=reduce_scatter,
                    average=average,
                    replicate_group=replicate_group,
                )
            )

    @property
    def numel(self) -> int:
        """Elements in each buffer, padding included."""
        return self.param_data.numel()

    @property
    def num_params(self) -> int:
        """Parameter elements in the buffer, padding excluded."""
        return self.ranges[-1].end

    @property
    def param_bytes(self) -> int:
        """Bytes of the parameter buffer."""
        return self.param_data.numel() * self.param_data.element_size()

    @property
    def grad_bytes(self) -> int:
        """Bytes of the gradient buffer."""
        return self.grad_data.numel() * self.grad_data.element_size()

    def broadcast_params(
        self, dp_group: ProcessGroup, replicate_group: ProcessGroup | None = None
    ) -> None:
        """Make every dp rank's parameters (every replica's, with HSDP) equal to dp rank 0's."""
        broadcast_from_first(self.param_data, dp_group, replicate_group)

    def zero_grad(self) -> None:
        """Zero the gradient buffer and await every gradient again."""
        self.grad_data.zero_()
        self._holding.clear()
        for bucket in self.buckets:
            bucket.reset()

    def holds_grad(self, index: int) -> bool:
        """Whether parameter ``index``'s view got a gradient since the last :meth:`zero_grad`."""
        return index in self._holding

    def mark_holds_grad(self, index: int) -> None:
        """Record that parameter ``index``'s view holds a gradient (later ones add to it)."""
        self._holding.add(index)
