"""P2PCommunicator on real processes: ring exchanges, variable shapes, contract checks."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mega_parallel_grid.testing import DistPool, rank_device
from mega_pipeline import P2PCommunicator
from mega_pipeline.p2p import group_device


def _group(**kwargs: Any) -> ProcessGroup:
    """All ranks in one group (keyword arguments go to ``dist.new_group``)."""
    kwargs.setdefault("timeout", timedelta(seconds=60))
    group = dist.new_group(list(range(dist.get_world_size())), **kwargs)
    assert isinstance(group, ProcessGroup)
    return group


def _ring(variable: bool) -> None:
    group = _group()
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    comm = P2PCommunicator(
        group, tensor_shape=None if variable else (2, 3), variable_shapes=variable
    )
    assert comm.device == rank_device()
    prev, nxt = (rank - 1) % size, (rank + 1) % size
    shape = (rank + 1, 3) if variable else (2, 3)
    prev_shape = (prev + 1, 3) if variable else (2, 3)
    act = torch.full(shape, float(rank), device=comm.device)
    grad = torch.full(prev_shape, 10.0 + rank, device=comm.device)
    # everything at once: activation to next, gradient to prev, and both receives
    from_prev, from_next = comm.exchange(
        send_next=act, send_prev=grad, recv_prev=True, recv_next=True, recv_next_shape=shape
    )
    assert from_prev is not None and from_next is not None
    assert torch.equal(from_prev, torch.full(prev_shape, float(prev), device=comm.device))
    assert torch.equal(from_next, torch.full(shape, 10.0 + nxt, device=comm.device))
    # the convenience pairs, along the open chain 0 -> size-1 (no wrap-around)
    first, last = rank == 0, rank == size - 1
    x = torch.full(shape, 1.0 + rank, device=comm.device)
    if not first:
        received = comm.recv_forward()
        assert torch.equal(received, torch.full(prev_shape, float(rank), device=comm.device))
    if not last:
        g = comm.send_forward_recv_backward(x)
        assert torch.equal(g, x * 2)
    if not first:
        comm.send_backward(received * 2)
    if not last:
        comm.send_forward(x + 1)
    if not first:
        assert torch.equal(comm.recv_forward(), received + 1)
        comm.send_backward(received)
    if not last:
        g = comm.recv_backward(shape=x.shape)
        assert torch.equal(g, x)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("variable", [False, True], ids=["fixed", "variable"])
def test_ring_exchange(dist_pool: DistPool, world: int, variable: bool) -> None:
    dist_pool.run(_ring, world, args=(variable,))


def _disagreeing_shapes() -> str:
    group = _group()
    shape = (4, 2, 16) if dist.get_rank() == 0 else (4, 2, 32)
    try:
        P2PCommunicator(group, tensor_shape=shape)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_stages_disagreeing_on_the_shape_fail_at_construction(dist_pool: DistPool) -> None:
    messages = dist_pool.run(_disagreeing_shapes, 2)
    assert messages[0] == messages[1]
    assert messages[0] == (
        "the pipeline stages disagree on the activations they exchange (pp rank 0 has "
        "tensor_shape (4, 2, 16), dtype torch.float32; pp rank 1 has tensor_shape (4, 2, 32), "
        "dtype torch.float32); build every stage's P2PCommunicator with the same tensor_shape, "
        "dtype and variable_shapes"
    )


def _wrong_send_and_peer_timeout() -> str:
    # gloo on CPU with a short timeout so the waiting peer gives up quickly
    group = _group(backend="gloo", timeout=timedelta(seconds=2))
    comm = P2PCommunicator(group, tensor_shape=(2, 3), device="cpu")
    message = "no error"
    try:
        if dist.get_rank() == 0:
            comm.send_forward(torch.zeros(2, 4))
        else:
            comm.recv_forward()
    except (ValueError, RuntimeError) as exc:
        message = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    return message


def test_wrong_shape_raises_on_sender_and_peer_times_out(dist_pool: DistPool) -> None:
    sender, receiver = dist_pool.run(_wrong_send_and_peer_timeout, 2)
    assert sender == (
        "ValueError: pp rank 0 would send an activation of shape (2, 4) and dtype torch.float32, "
        "but the stages agreed on tensor_shape (2, 3) and dtype torch.float32; make the stage's "
        "output match, or build the P2PCommunicator with variable_shapes=True"
    )
    assert receiver.startswith("RuntimeError: pp rank 1: the exchange with pp ranks 0 and 0 failed")
    assert "a neighbouring stage has probably failed or timed out" in receiver


def _single_rank_needs_no_comm() -> None:
    group = _group()
    comm = P2PCommunicator(group, tensor_shape=(2,))
    assert comm.size == 1
    try:
        comm.send_forward(torch.zeros(2))
    except ValueError as exc:
        assert "no neighbour" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def test_single_stage(dist_pool: DistPool) -> None:
    dist_pool.run(_single_rank_needs_no_comm, 1)


def _constructor_errors() -> list[str]:
    group = _group()
    messages = []
    cases: list[dict[str, Any]] = [
        {},
        {"tensor_shape": (2, 0)},
        {"tensor_shape": (2,), "dtype": "bf16"},
    ]
    for kwargs in cases:
        try:
            P2PCommunicator(group, **kwargs)
        except (ValueError, TypeError) as exc:
            messages.append(str(exc))
    return messages


def test_constructor_checks_arguments(dist_pool: DistPool) -> None:
    messages = dist_pool.run(_constructor_errors, 1)[0]
    assert messages == [
        "P2PCommunicator needs tensor_shape (the shape of the activations passed between "
        "stages, e.g. (seq, micro_batch, hidden)) or variable_shapes=True",
        "tensor_shape (2, 0) must be a non-empty sequence of positive integers",
        "dtype ('bf16') must be a torch.dtype, e.g. torch.bfloat16",
    ]


def test_group_device_follows_nccl_also_beside_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    """A "cpu:gloo,cuda:nccl" group (gloo for CPU tensors) still sends activations by NCCL."""
    group = cast(ProcessGroup, object())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for backend, expected in (
        ("nccl", torch.device("cuda", 1)),
        ("cpu:gloo,cuda:nccl", torch.device("cuda", 1)),
        ("gloo", torch.device("cpu")),
    ):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert group_device(group) == expected, backend
