"""Point-to-point transfers between adjacent pipeline stages, batched in both directions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["MAX_DIMS", "P2PCommunicator", "PendingExchange", "group_device"]

#: Most dimensions an activation may have in variable-shape mode.
MAX_DIMS = 8

_CONTRACT_BYTES = 128


def group_device(group: ProcessGroup) -> torch.device:
    """The current CUDA device when ``group`` runs NCCL, else the CPU.

    A group whose backend string names NCCL for CUDA tensors beside another backend
    (e.g. ``"cpu:gloo,cuda:nccl"``) counts as NCCL: its CUDA tensors travel by NCCL.
    """
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class P2PCommunicator:
    """Sends activations forward and gradients backward between neighbouring pp ranks.

    The neighbours form a ring (the rank after the last is the first), as the
    interleaved schedule needs; the schedules decide who sends what. Every exchange is
    one ``batch_isend_irecv`` posting, in this order, the activation for the next rank,
    the gradient for the previous rank, the activation from the previous rank and the
    gradient from the next rank, then waiting for all of them.

    Activations have one agreed ``tensor_shape`` and ``dtype`` (gradients travel with the
    shape and dtype of their activation), or, with ``variable_shapes=True``, each
    activation is preceded by a small message carrying its shape. The constructor checks
    that every rank of ``pp_group`` agreed on the same contract (one small all-gather,
    which also sets up NCCL's communicator), so every rank must build its communicator
    at the same point. Collectives time out after the group's timeout.
    """

    def __init__(
        self,
        pp_group: ProcessGroup,
        *,
        tensor_shape: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        variable_shapes: bool = False,
    ) -> None:
        if tensor_shape is None and not variable_shapes:
            raise ValueError(
                "P2PCommunicator needs tensor_shape (the shape of the activations passed "
                "between stages, e.g. (seq, micro_batch, hidden)) or variable_shapes=True"
            )
        if tensor_shape is not None:
            shape = tuple(tensor_shape)
            if not shape or any(not isinstance(d, int) or d < 1 for d in shape):
                raise ValueError(
                    f"tensor_shape {shape!r} must be a non-empty sequence of positive integers"
                )
            if len(shape) > MAX_DIMS:
                raise ValueError(
                    f"tensor_shape {shape!r} has {len(shape)} dimensions; at most {MAX_DIMS} "
                    "are supported"
                )
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype ({dtype!r}) must be a torch.dtype, e.g. torch.bfloat16")
        self.group = pp_group
        self.size = dist.get_world_size(pp_group)
        self.rank = dist.get_rank(pp_group)
        self.tensor_shape: tuple[int, ...] | None = (
            None if tensor_shape is None else tuple(tensor_shape)
        )
        self.dtype = dtype
        self.variable_shapes = variable_shapes
        self.device = torch.device(device) if device is not None else group_device(pp_group)
        self.next_rank = dist.get_global_rank(pp_group, (self.rank + 1) % self.size)
        self.prev_rank = dist.get_global_rank(pp_group, (self.rank - 1) % self.size)
        if self.size > 1:
            self._check_contract()

    def _contract(self) -> str:
        shape = "variable shapes" if self.variable_shapes else f"tensor_shape {self.tensor_shape}"
        return f"{shape}, dtype {self.dtype}"

    def _check_contract(self) -> None:
        text = self._contract().encode()[:_CONTRACT_BYTES]
        mine = torch.zeros(_CONTRACT_BYTES, dtype=torch.uint8, device=self.device)
        mine[: len(text)] = torch.tensor(list(text), dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        texts = [bytes(t.cpu().tolist()).rstrip(b"\0").decode() for t in every]
        if len(set(texts)) > 1:
            listed = "; ".join(f"pp rank {r} has {t}" for r, t in enumerate(texts))
            raise ValueError(
                f"the pipeline stages disagree on the activations they exchange ({listed}); "
                "build every stage's P2PCommunicator with the same tensor_shape, dtype "
                "and variable_shapes"
            )

    def _check_send(self, tensor: Tensor, what: str) -> Tensor:
        if self.tensor_shape is not None and not self.variable_shapes:
            if tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
                raise ValueError(
                    f"pp rank {self.rank} would send {what} of shape {tuple(tensor.shape)} "
                    f"and dtype {tensor.dtype}, but the stages agreed on tensor_shape "
                    f"{self.tensor_shape} and dtype {self.dtype}; make the stage's output "
                    "match, or build the P2PCommunicator with variable_shapes=True"
                )
        elif tensor.dtype != self.dtype:
            raise ValueError(
                f"pp rank {self.rank} would send {what} of dtype {tensor.dtype}, but the "
                f"stages agreed on dtype {self.dtype}; cast the stage's output"
            )
        if tensor.dim() > MAX_DIMS:
            raise ValueError(
                f"pp rank {self.rank} would send {what} with {tensor.dim()} dimensions; "
                f"at most {MAX_DIMS} are supported"
            )
        return tensor.detach().contiguous()

    def _batch(self, ops: list[dist.P2POp], what: str) -> None:
        self._wait(self._post(ops, what), what)

    def _post(self, ops: list[dist.P2POp], what: str) -> list[Any]:
        if not ops:
            return []
        try:
            return list(dist.batch_isend_irecv(ops))
        except RuntimeError as exc:
            raise self._failed(what, exc) from exc

    def _wait(self, requests: list[Any], what: str) -> None:
        try:
            for request in requests:
                request.wait()
        except RuntimeError as exc:
            raise self._failed(what, exc) from exc

    def _failed(self, what: str, exc: Exception) -> RuntimeError:
        return RuntimeError(
            f"pp rank {self.rank}: {what} with pp ranks {(self.rank - 1) % self.size} and "
            f"{(self.rank + 1) % self.size} failed ({exc}); a neighbouring stage has "
            "probably failed or timed out, see its error"
        )

    def _op(self, send: bool, tensor: Tensor, peer: int) -> dist.P2POp:
        return dist.P2POp(dist.isend if send else dist.irecv, tensor, peer, self.group)

    def _exchange_shapes(self, send_next: Tensor | None, recv_prev: bool) -> tuple[int, ...] | None:
        """Send the activation's shape ahead of it; return the incoming activation's shape."""
        ops = []
        if send_next is not None:
            header = torch.zeros(MAX_DIMS + 1, dtype=torch.int64, device=self.device)
            header[0] = send_next.dim()
            header[1 : send_next.dim() + 1] = torch.tensor(send_next.shape)
            ops.append(self._op(True, header, self.next_rank))
        incoming = None
        if recv_prev:
            incoming = torch.empty(MAX_DIMS + 1, dtype=torch.int64, device=self.device)
            ops.append(self._op(False, incoming, self.prev_rank))
        self._batch(ops, "the shape exchange")
        if incoming is None:
            return None
        values = incoming.tolist()
        return tuple(values[1 : values[0] + 1])

    def exchange(
        self,
        *,
        send_next: Tensor | None = None,
        send_prev: Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
        recv_next_shape: Sequence[int] | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """Send and receive in one batch; return (activation from prev, gradient from next).

        ``send_next`` is an activation for the next rank, ``send_prev`` a gradient for
        the previous one. ``recv_next_shape`` is the shape of the expected gradient: the
        shape of the activation it belongs to (only needed with variable shapes).
        """
        return self.start_exchange(
            send_next=send_next, send_prev=send_prev, recv_prev=recv_prev,
            recv_next=recv_next, recv_next_shape=recv_next_shape,
        ).wait()  # fmt: skip

    def start_exchange(
        self,
        *,
        send_next: Tensor | None = None,
        send_prev: Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
        recv_next_shape: Sequence[int] | None = None,
    ) -> PendingExchange:
        """:meth:`exchange` posted without waiting: compute meanwhile, then ``.wait()``.

        With variable shapes the shape messages still go first, waited for.
        """
        ops, from_prev, from_next = self._prepare(
            send_next=send_next, send_prev=send_prev, recv_prev=recv_prev,
            recv_next=recv_next, recv_next_shape=recv_next_shape,
        )  # fmt: skip
        return PendingExchange(self, self._post(ops, "the exchange"), from_prev, from_next)

    def start_exchanges(self, parts: Sequence[Mapping[str, Any]]) -> list[PendingExchange]:
        """Several :meth:`start_exchange` calls (their keyword arguments, in order) posted
        as one ``batch_isend_irecv``; the ops keep their order, so each channel's messages
        match first-in first-out. Waiting for the first waits for them all. With
        variable shapes each part is posted on its own, its shapes first."""
        if self.variable_shapes or len(parts) < 2:
            return [self.start_exchange(**part) for part in parts]
        ops: list[dist.P2POp] = []
        received = []
        for part in parts:
            part_ops, from_prev, from_next = self._prepare(**part)
            ops += part_ops
            received.append((from_prev, from_next))
        requests = self._post(ops, "the exchange")
        return [
            PendingExchange(self, requests if i == 0 else [], *r) for i, r in enumerate(received)
        ]

    def _prepare(
        self,
        *,
        send_next: Tensor | None = None,
        send_prev: Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
        recv_next_shape: Sequence[int] | None = None,
    ) -> tuple[list[dist.P2POp], Tensor | None, Tensor | None]:
        """One exchange's ops in posting order and its receive buffers."""
        if self.size == 1 and (
            send_next is not None or send_prev is not None or recv_prev or recv_next
        ):
            raise ValueError("a pipeline of one stage has no neighbour to exchange tensors with")
        ops: list[dist.P2POp] = []
        if send_next is not None:
            send_next = self._check_send(send_next, "an activation")
        if send_prev is not None:
            send_prev = self._check_send(send_prev, "a gradient")
        prev_shape = self.tensor_shape
        if self.variable_shapes and (send_next is not None or recv_prev):
            prev_shape = self._exchange_shapes(send_next, recv_prev)
        next_shape = self.tensor_shape
        if recv_next_shape is not None:
            next_shape = tuple(recv_next_shape)
        elif recv_next and self.variable_shapes:
            raise ValueError(
                "with variable_shapes=True receiving a gradient needs recv_next_shape, "
                "the shape of the activation it belongs to"
            )
        from_prev = from_next = None
        if send_next is not None:
            ops.append(self._op(True, send_next, self.next_rank))
        if send_prev is not None:
            ops.append(self._op(True, send_prev, self.prev_rank))
        if recv_prev:
            assert prev_shape is not None
            from_prev = torch.empty(prev_shape, dtype=self.dtype, device=self.device)
            ops.append(self._op(False, from_prev, self.prev_rank))
        if recv_next:
            assert next_shape is not None
            from_next = torch.empty(next_shape, dtype=self.dtype, device=self.device)
            ops.append(self._op(False, from_next, self.next_rank))
        return ops, from_prev, from_next

    def send_forward(self, activation: Tensor) -> None:
        """Send an activation to the next stage."""
        self.exchange(send_next=activation)

    def recv_forward(self) -> Tensor:
        """Receive an activation from the previous stage."""
        received, _ = self.exchange(recv_prev=True)
        assert received is not None
        return received

    def send_backward(self, gradient: Tensor) -> None:
        """Send a gradient to the previous stage."""
        self.exchange(send_prev=gradient)

    def recv_backward(self, shape: Sequence[int] | None = None) -> Tensor:
        """Receive a gradient from the next stage (``shape``: its activation's shape)."""
        _, received = self.exchange(recv_next=True, recv_next_shape=shape)
        assert received is not None
        return received

    def send_forward_recv_backward(self, activation: Tensor) -> Tensor:
        """Send an activation forward and receive its stage's next gradient, in one batch."""
        _, received = self.exchange(
            send_next=activation, recv_next=True, recv_next_shape=activation.shape
        )
        assert received is not None
        return received

    def send_backward_recv_forward(self, gradient: Tensor) -> Tensor:
        """Send a gradient backward and receive the next activation, in one batch."""
        received, _ = self.exchange(send_prev=gradient, recv_prev=True)
        assert received is not None
        return received


class PendingExchange:
    """A posted :meth:`P2PCommunicator.start_exchange`; :meth:`wait` completes it."""

    def __init__(
        self,
        comm: P2PCommunicator,
        requests: list[Any],
        from_prev: Tensor | None,
        from_next: Tensor | None,
    ) -> None:
        self._comm, self._requests = comm, requests
        self._received = (from_prev, from_next)

    def wait(self) -> tuple[Tensor | None, Tensor | None]:
        """Wait for every send and receive; return (activation from prev, gradient from next)."""
        self._comm._wait(self._requests, "the exchange")
        self._requests = []
        return self._received
