"""A GPT chunk's overlapped pair (mega-pipeline's ``OverlappedForwardBackward``) against the
same forward and backward run apart, and a trace of the MoE all-to-all overlap.

Two ranks, ep 2 for the MoE model (each rank's tokens reach both ranks' experts). Chunk Y
records the forward of micro-batch j; chunk X then runs micro-batch i's forward with j's
backward interleaved. Copies of X and Y (same seeds) run the forward of i and the
backward of j one after the other: X's loss and both chunks' gradients must agree
(fp32, the models' reduction length); j's forward runs under a split backward, whose
weight gradients still wait for the W pass, and each of Y's parameters accumulates its
gradient once (the hook DDP's buckets use). In the MoE case the trace of a wrapper around the
all-to-all and of Y's layers' backward hooks shows X's first token all-to-alls
(dispatch, combine) issued before one of Y's layer backwards starts and waited for after
it ends, and Y's layer backwards spread between X's layer forwards.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _tolerance import model_reduction_length

from mega_models import GPTConfig, GPTModel, model_config
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_pipeline import OverlappedForwardBackward
from mega_tp_layers import defer_weight_grads

SEQ, BATCH = 8, 2
MOE = {
    "hidden_size": 32, "num_layers": 3, "num_attention_heads": 4, "num_query_groups": 2,
    "num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 32,
}  # fmt: skip


def _config(moe: bool) -> GPTConfig:
    base = model_config("tiny")
    return base.replace(**MOE) if moe else base.replace(num_layers=3)


def _batch(config: GPTConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


class _Traced:
    """Logs the asynchronous all-to-alls (issue, wait) and named events, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []
        self.issued = 0
        self._real = dist.all_to_all_single

    def all_to_all_single(self, *args: Any, **kwargs: Any) -> Any:
        work = self._real(*args, **kwargs)
        if not kwargs.get("async_op"):
            return work
        n = str(self.issued)
        self.issued += 1
        self.events.append(("issue", n))
        traced = self

        class _Work:
            def wait(self) -> Any:
                out = work.wait()
                traced.events.append(("wait", n))
                return out

        return _Work()


def _pair(moe: bool) -> None:
    config = _config(moe)
    groups = init_process_groups(ParallelConfig(ep=2 if moe else 1))
    dev = rank_device()
    x, y = (GPTModel(config, groups, seed=s, device=dev) for s in (3, 4))
    x_ref, y_ref = (GPTModel(config, groups, seed=s, device=dev) for s in (3, 4))
    assert isinstance(x, OverlappedForwardBackward)
    (ids_i, labels_i), (ids_j, labels_j) = _batch(config, 10), _batch(config, 20)
    traced = _Traced()
    hooks = []
    for name, layer in y.layers.items():
        hooks.append(
            layer.register_full_backward_pre_hook(
                lambda m, g, n=name: traced.events.append(("y backward starts", n)) and None
            )
        )
        hooks.append(
            layer.register_full_backward_hook(
                lambda m, gi, go, n=name: traced.events.append(("y backward ends", n)) and None
            )
        )
    for name, layer in x.layers.items():
        hooks.append(layer.register_forward_pre_hook(
            lambda m, a, n=name: traced.events.append(("x forward", n)) and None))  # fmt: skip
    accumulated: dict[str, int] = {}  # Y's gradient hooks (what DDP hangs its buckets on)
    for pname, p in y.named_parameters():
        hooks.append(p.register_post_accumulate_grad_hook(
            lambda _, n=pname: accumulated.__setitem__(n, accumulated.get(n, 0) + 1)))  # fmt: skip
    # j's forward under a split backward: its linears' weight gradients wait for W
    with defer_weight_grads() as w_pass, y.overlap_record() as record:
        loss_j = y(ids_j.to(dev), labels_j.to(dev)).mean()
    assert len(record.boundaries) == config.num_layers
    traced.events.clear()
    # apart: i's forward, then j's backward (B, then W)
    with defer_weight_grads() as w_pass_ref:
        loss_j_ref = y_ref(ids_j.to(dev), labels_j.to(dev)).mean()
    loss_i_ref = x_ref(ids_i.to(dev), labels_i.to(dev)).mean()
    loss_j_ref.backward()
    w_pass_ref.run()
    # overlapped, traced
    dist.all_to_all_single = traced.all_to_all_single
    try:
        loss_i = x.overlapped_forward_backward(
            lambda: x(ids_i.to(dev), labels_i.to(dev)).mean(), record, loss_j, None
        )
    finally:
        dist.all_to_all_single = traced._real
    assert not record.boundaries  # every piece ran
    deferred = {n for n, p in y.named_parameters() if p.grad is None}
    assert len(w_pass) > 0 and deferred, "the linears' W waits for the W pass"
    w_pass.run()
    for hook in hooks:
        hook.remove()
    assert accumulated == {n: 1 for n, _ in y.named_parameters()}, accumulated  # once each
    loss_i.backward()
    loss_i_ref.backward()
    n = model_reduction_length(config, seq=SEQ, tokens=2 * SEQ * BATCH)
    assert_close_to_reference(loss_i, loss_i_ref, reduction_length=n, name="x loss")
    for model, ref in ((x, x_ref), (y, y_ref)):
        refs = dict(ref.named_parameters())
        for pname, p in model.named_parameters():
            expected = refs[pname].grad
            assert p.grad is not None and expected is not None, pname
            assert_close_to_reference(p.grad, expected, reduction_length=n, name=pname)
    events = traced.events
    starts = [i for i, e in enumerate(events) if e[0] == "y backward starts"]
    forwards = [i for i, e in enumerate(events) if e[0] == "x forward"]
    assert len(forwards) == config.num_layers and len(starts) == config.num_layers, events
    assert starts[0] < forwards[-1]  # interleaved, not one after the other
    if not moe:
        assert traced.issued == 0
        return
    assert traced.issued == 2 * config.num_layers  # dispatch and combine of each MoE layer
    # Y's backward has one piece per layer (the first with the head) and one for the
    # embedding; X's first boundary runs the first, its first MoE layer's dispatch and
    # combine the next two: those all-to-alls are in flight across a whole layer backward
    for k in ("0", "1"):
        issue, wait = events.index(("issue", k)), events.index(("wait", k))
        between = events[issue:wait]
        ended = {e[1] for e in between if e[0] == "y backward ends"}
        started = {e[1] for e in between if e[0] == "y backward starts"}
        assert ended & started, (k, between)


@pytest.mark.parametrize("moe", [True, False], ids=["moe-ep2", "dense"])
def test_overlapped_pair_equals_the_pair_apart(dist_pool: DistPool, moe: bool) -> None:
    dist_pool.run(_pair, 2, args=(moe,))
