"""Bad input fails at once, in one sentence naming the values; never a hang."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from mega_parallel_grid.testing import DistPool
from mega_pipeline import (
    P2PCommunicator,
    StageChunk,
    broadcast_losses,
    forward_backward_1f1b,
    forward_backward_interleaved,
    forward_backward_no_pipelining,
    get_forward_backward_func,
)


def _group(**kwargs: Any) -> ProcessGroup:
    """All ranks in one group (keyword arguments go to ``dist.new_group``)."""
    group = dist.new_group(list(range(dist.get_world_size())), **kwargs)
    assert isinstance(group, ProcessGroup)
    return group


def _step(it: Any, chunk: StageChunk) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    out = chunk(torch.ones(2, 3, 4))
    return out, lambda o: o.pow(2).mean()


def _message(call: Callable[[], object]) -> str:
    try:
        call()
    except (ValueError, TypeError) as exc:
        assert "\n" not in str(exc)
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _schedule_errors() -> list[str]:
    group = _group(timeout=timedelta(seconds=60))
    comm = P2PCommunicator(group, tensor_shape=(2, 3, 4))
    one, two = nn.Linear(4, 4), [nn.Linear(4, 4), nn.Linear(4, 4)]
    kw: dict[str, Any] = {"forward_step": _step, "communicator": comm}
    return [
        _message(
            lambda: forward_backward_interleaved(
                data_iterator=[None, None], model=two, num_microbatches=3, **kw
            )
        ),
        _message(
            lambda: forward_backward_1f1b(data_iterator=None, model=two, num_microbatches=2, **kw)
        ),
        _message(
            lambda: forward_backward_no_pipelining(
                data_iterator=None, model=one, num_microbatches=2, **kw
            )
        ),
        _message(
            lambda: forward_backward_interleaved(
                data_iterator=None, model=two, num_microbatches=2, **kw
            )
        ),
        _message(
            lambda: forward_backward_interleaved(
                data_iterator=[None], model=two, num_microbatches=2, **kw
            )
        ),
    ]


def test_schedule_input_errors_on_every_rank(dist_pool: DistPool) -> None:
    first, second = dist_pool.run(_schedule_errors, 2)
    assert (
        first
        == second
        == [
            "ValueError: the interleaved schedule needs num_microbatches (3) to be a multiple of "
            "pp (2); use a multiple of 2 microbatches",
            "ValueError: forward_backward_1f1b runs one chunk per rank, but the model has 2; use "
            "forward_backward_interleaved for virtual pipeline chunks",
            "ValueError: forward_backward_no_pipelining runs one stage with one chunk, but pp is 2 "
            "and the model has 1 chunks; use get_forward_backward_func(pp, vpp)",
            "ValueError: the model has 2 chunks on this rank but a single data_iterator was given; "
            "pass a list of 2 iterators (or None), one per chunk",
            "ValueError: data_iterator is a list of 1, but the model has 2 chunks on this rank; "
            "pass one iterator (or None) per chunk",
        ]
    )


def _mismatched_stage_output() -> str:
    # gloo on CPU with a short timeout, so the waiting stage gives up quickly
    group = _group(backend="gloo", timeout=timedelta(seconds=2))
    comm = P2PCommunicator(group, tensor_shape=(2, 3, 4), device="cpu")
    # stage 0 widens to 5 features: its output no longer matches the agreed shape
    chunk = nn.Linear(4, 5) if dist.get_rank() == 0 else nn.Linear(5, 4)
    message = _message_runtime(
        lambda: forward_backward_1f1b(
            forward_step=_step,
            data_iterator=None,
            model=chunk,
            num_microbatches=2,
            communicator=comm,
        )
    )
    dist.barrier()
    return message


def _message_runtime(call: Callable[[], object]) -> str:
    try:
        call()
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_mismatched_stage_output_is_named_not_hung(dist_pool: DistPool) -> None:
    sender, receiver = dist_pool.run(_mismatched_stage_output, 2)
    assert sender == (
        "ValueError: pp rank 0 would send an activation of shape (2, 3, 5) and dtype "
        "torch.float32, but the stages agreed on tensor_shape (2, 3, 4) and dtype torch.float32; "
        "make the stage's output match, or build the P2PCommunicator with variable_shapes=True"
    )
    assert receiver.startswith("RuntimeError: pp rank 1: the exchange with pp ranks 0 and 0")


def test_layout_errors_without_processes() -> None:
    cases = [
        (
            lambda: get_forward_backward_func(1, 2),
            "vpp (2) needs pipeline parallelism, but pp is 1; set pp > 1 or leave vpp unset",
        ),
        (lambda: get_forward_backward_func(0), "pp_size (0) must be a positive integer"),
        (
            lambda: get_forward_backward_func(2, 0),
            "vpp_size (0) must be a positive integer, or None for no interleaving",
        ),
        (
            lambda: forward_backward_interleaved(
                forward_step=_step,
                data_iterator=[None, None],
                model=[nn.Linear(4, 4), nn.Linear(4, 4)],
                num_microbatches=2,
            ),
            "vpp (2) needs pipeline parallelism, but pp is 1; set pp > 1 or pass one chunk",
        ),
    ]
    for call, message in cases:
        assert _message(call) == f"ValueError: {message}"
    assert get_forward_backward_func(1) is forward_backward_no_pipelining
    assert get_forward_backward_func(1, 1) is forward_backward_no_pipelining
    assert get_forward_backward_func(4) is forward_backward_1f1b
    assert get_forward_backward_func(4, 1) is forward_backward_1f1b
    assert get_forward_backward_func(4, 2) is forward_backward_interleaved


def test_user_callback_errors_without_processes() -> None:
    model = nn.Linear(4, 4)

    def no_tuple(it: Any, chunk: StageChunk) -> Any:
        return chunk(torch.ones(2, 4))

    def vector_loss(it: Any, chunk: StageChunk) -> Any:
        return chunk(torch.ones(2, 4)), lambda o: o.sum(0)

    def bad_loss(it: Any, chunk: StageChunk) -> Any:
        return chunk(torch.ones(2, 4)), lambda o: [o.sum()]

    run = forward_backward_no_pipelining
    assert _message(
        lambda: run(forward_step=no_tuple, data_iterator=None, model=model, num_microbatches=1)
    ) == ("TypeError: forward_step returned Tensor; it must return (output_tensor, loss_func)")
    assert _message(
        lambda: run(forward_step=vector_loss, data_iterator=None, model=model, num_microbatches=1)
    ) == (
        "ValueError: loss_func returned a loss of shape (4,); return one scalar per microbatch "
        "(e.g. the mean over its tokens)"
    )
    assert _message(
        lambda: run(forward_step=bad_loss, data_iterator=None, model=model, num_microbatches=1)
    ) == (
        "TypeError: loss_func returned list; return a scalar loss tensor or (loss, {name: tensor}) "
        "for logging"
    )
    assert _message(
        lambda: run(
            forward_step=_step, data_iterator=None, model=cast(Any, "x"), num_microbatches=1
        )
    ) == ("TypeError: model must be an nn.Module or a non-empty list of nn.Module chunks")
    assert _message(
        lambda: run(forward_step=_step, data_iterator=None, model=model, num_microbatches=0)
    ) == ("ValueError: num_microbatches (0) must be a positive integer")


def test_no_pipelining_runs_without_processes() -> None:
    """One stage needs no process group: plain accumulation, loss divided by m."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    xs = [torch.randn(2, 4) for _ in range(3)]
    losses = forward_backward_no_pipelining(
        forward_step=lambda it, chunk: (chunk(next(cast(Any, it))), lambda o: o.pow(2).mean()),
        data_iterator=iter(xs),
        model=model,
        num_microbatches=3,
    )
    grads = [cast(Tensor, p.grad).clone() for p in model.parameters()]
    model.zero_grad()
    for x in xs:
        (model(x).pow(2).mean() / 3).backward()
    for g, p in zip(grads, model.parameters(), strict=True):
        assert torch.equal(g, cast(Tensor, p.grad))
    with torch.no_grad():
        assert [float(d["loss"]) for d in losses] == [float(model(x).pow(2).mean()) for x in xs]


def test_loss_func_logs_that_are_not_tensors_are_one_sentence() -> None:
    """A logged float (or logs that are not a dict) is named, not an AttributeError."""

    def logs_float(it: Any, chunk: StageChunk) -> Any:
        out = chunk(torch.ones(2, 4))
        return out, lambda o: (o.pow(2).mean(), {"acc": 0.5})

    def logs_list(it: Any, chunk: StageChunk) -> Any:
        out = chunk(torch.ones(2, 4))
        return out, lambda o: (o.pow(2).mean(), [o.mean()])

    def message(step: Callable[[Any, StageChunk], Any]) -> str:
        return _message(
            lambda: forward_backward_no_pipelining(
                forward_step=step, data_iterator=None, model=nn.Linear(4, 4), num_microbatches=1
            )
        )

    messages = [message(logs_float), message(logs_list)]
    assert messages == [
        "TypeError: loss_func logged values that are not tensors ({'acc': 'float'}); log each "
        "as a tensor, e.g. torch.tensor(value) or loss.detach()",
        "TypeError: loss_func returned (loss, list); the values to log must be a dict "
        "{name: tensor}",
    ]


def _broadcast_bad_records() -> str:
    # a timeout well above any scheduling skew on a loaded machine, well below gloo's
    # default 30 minutes: a rank left waiting for the source fails the test, not hangs it
    group = _group(backend="gloo", timeout=timedelta(seconds=60))
    last = dist.get_rank(group) == 1
    one = torch.tensor(1.0)
    # the last rank's microbatches log different names: it cannot share them
    losses = [{"loss": one}, {"loss": one, "acc": one}] if last else []
    message = _message_runtime(lambda: broadcast_losses(losses, group, device="cpu"))
    dist.barrier()
    return message


def test_broadcast_losses_bad_records_fail_on_every_rank(dist_pool: DistPool) -> None:
    """The source's error reaches every rank at once, not as a timeout on the others."""
    source, other = dist_pool.run(_broadcast_bad_records, 2)[::-1]
    assert (
        source
        == other
        == (
            "ValueError: broadcast_losses needs every microbatch to log the same scalar names; "
            "got ['acc', 'loss'] after ['loss']"
        )
    )


def _broadcast_one_rank() -> list[str]:
    group = _group()
    losses = [{"loss": torch.tensor([1.5], dtype=torch.bfloat16), "n": torch.tensor(3)}]
    shared = broadcast_losses(losses, group, device="cpu")
    bad = [{"loss": torch.tensor(1.0)}, {"acc": torch.tensor(1.0)}]
    return [
        *(f"{n} {tuple(v.shape)} {v.dtype} {float(v)}" for n, v in shared[0].items()),
        _message(lambda: broadcast_losses(bad, group)),
    ]


def test_broadcast_losses_on_one_rank_as_on_several(dist_pool: DistPool) -> None:
    """pp 1: fp32 scalars on the device and the same checks, as a group of several gives."""
    assert dist_pool.run(_broadcast_one_rank, 1)[0] == [
        "loss () torch.float32 1.5",
        "n () torch.float32 3.0",
        "ValueError: broadcast_losses needs every microbatch to log the same scalar names; "
        "got ['acc'] after ['loss']",
    ]
