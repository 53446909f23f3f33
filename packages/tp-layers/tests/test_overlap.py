"""``tp_comm_overlap`` layers == the same sequence-parallel layers without the overlap.

Both variants run on the same ranks with the same weights, inputs and output gradients.
Every overlapped GEMM is a row slice of the plain layer's GEMM (``mm``/``addmm``, or the
fp8 GEMM with the scale of the whole tensor), so the only possible difference is the
order in which the tp partial products of a reduce-scatter are added:

- column forward (all-gather, no sums) and all weight/bias gradients: bitwise equal at
  any tp; at tp = 2 everything is bitwise equal too (a + b == b + a, and CPU BLAS rounds a
  row slice of a GEMM exactly as the whole GEMM — which this test would catch if not);
- tp = 3, 4: the ring adds the partials in ring order, gloo's reduce-scatter in its
  own; three or four fp32 partials summed in another order differ by a few ulps of their
  size, hence the rounding bound of ``assert_close_to_reference`` with n = tp on the row
  output and the input gradient.

fp8 is emulated (``Fp8Recipe(emulate=True)``) on shapes whose whole GEMMs qualify for
fp8 while the tp = 4 chunks (8 rows) alone would not, so the whole-tensor decision and
scales are what is tested.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tp_testing import error_messages, recorded_dist_calls
from torch import Tensor, nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_tp_layers import (
    ColumnParallelLinear,
    Fp8Recipe,
    Normal,
    RowParallelLinear,
    column_parallel_linear,
    shard_tensor,
)
from mega_tp_layers.overlap import ring_all_gather, ring_reduce_scatter

SEED = 5
EMULATE = Fp8Recipe(emulate=True)
# (S, B, H, FFN, heads): every size divisible by tp in {2, 3, 4}; the fp8 set has GEMM dims
# that are multiples of 16 for tp in {2, 4}
PLAIN = (12, 2, 24, 48, 12)
FP8 = (16, 2, 64, 128, 4)
COUNTED = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "batch_isend_irecv")


def count_calls() -> AbstractContextManager[list[str]]:
    """Record the name of every counted torch.distributed call issued inside."""
    return recorded_dist_calls(COUNTED, lambda name, kw: name)


def _attention(qkv: Tensor, heads: int, head_dim: int) -> Tensor:
    """Causal attention on a head-major fused projection ``[s, b, heads * 3 * d]``."""
    s, b, _ = qkv.shape
    q, k, v = qkv.view(s, b, heads, 3, head_dim).permute(3, 1, 2, 0, 4).unbind(0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * head_dim)


def _block(
    kind: str, overlap: bool, g: Any, shapes: tuple[int, ...], fp8: Fp8Recipe | None, bias: bool
) -> tuple[nn.Module, Callable[[Tensor], tuple[Tensor, Tensor]]]:
    """An MLP (Column -> GELU -> Row) or attention (QKV Column -> SDPA -> Row) block."""
    _, _, h, ffn, heads = shapes
    tp = dist.get_world_size(g)
    common: dict[str, Any] = {"tp_group": g, "sequence_parallel": True, "bias": bias,
                              "init_method": Normal(0.3), "seed": SEED, "device": rank_device(),
                              "fp8": fp8, "tp_comm_overlap": overlap}  # fmt: skip
    width = ffn if kind == "mlp" else 3 * h
    first = ColumnParallelLinear(h, width, name=f"{kind}.fc1", **common)
    second = RowParallelLinear(width if kind == "mlp" else h, h, name=f"{kind}.fc2", **common)
    if bias:  # non-zero biases, the same for both variants
        gen = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            assert first.bias is not None and second.bias is not None
            first.bias.copy_(torch.randn(first.bias.shape, generator=gen))
            second.bias.copy_(torch.randn(second.bias.shape, generator=gen))

    def run(x: Tensor) -> tuple[Tensor, Tensor]:
        hidden = first(x)  # [s/tp, b, h] -> [s, b, width/tp]
        if kind == "mlp":
            inner = F.gelu(hidden)
        else:
            inner = _attention(hidden, heads // tp, h // heads)
        return hidden, second(inner)  # -> [s/tp, b, h]

    return nn.ModuleList([first, second]), run


def _check_block(kind: str, tp: int, fp8: bool, bias: bool) -> dict[str, Counter[str]]:
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank, dev = dist.get_rank(g), rank_device()
    shapes = FP8 if fp8 else PLAIN
    s, b, h = shapes[:3]
    recipe = EMULATE if fp8 else None
    gen = torch.Generator().manual_seed(SEED + 1)
    x = shard_tensor(torch.randn(s, b, h, generator=gen), 0, rank, tp).to(dev)
    dy = shard_tensor(torch.randn(s, b, h, generator=gen), 0, rank, tp).to(dev)
    results, calls = [], {}
    for overlap in (False, True):
        layers, run = _block(kind, overlap, g, shapes, recipe, bias)
        xp = x.clone().requires_grad_()
        with count_calls() as fwd:
            hidden, y = run(xp)
        with count_calls() as bwd:
            y.backward(dy)
        grads = {n: p.grad for n, p in layers.named_parameters()}
        results.append((hidden, y, xp.grad, grads))
        calls = {"forward": Counter(fwd), "backward": Counter(bwd)}
    (h0, y0, gx0, grads0), (h1, y1, gx1, grads1) = results
    assert torch.equal(h1, h0), "column output (all-gather, no sums) must be bitwise equal"
    assert grads0.keys() == grads1.keys()
    for name, grad in grads0.items():
        assert grad is not None and grads1[name] is not None
        assert torch.equal(grads1[name], grad), f"{name} grad must be bitwise equal"
    for what, new, old in (("output", y1, y0), ("input grad", gx1, gx0)):
        assert new is not None and old is not None
        if tp == 2:
            assert torch.equal(new, old), f"{what} must be bitwise equal at tp=2"
        else:
            assert_close_to_reference(new, old, reduction_length=tp, name=what)
    return calls


BLOCKS = [("mlp", tp, False, bias) for tp in (2, 3, 4) for bias in (True, False)]
BLOCKS += [("attention", tp, False, True) for tp in (2, 3, 4)]
BLOCKS += [(kind, tp, True, bias) for kind in ("mlp", "attention") for tp in (2, 4)
           for bias in ((True, False) if kind == "mlp" else (True,))]  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "tp", "fp8", "bias"),
    BLOCKS,
    ids=[f"{k}-tp{t}{'-fp8' if f else ''}{'' if b else '-nobias'}" for k, t, f, b in BLOCKS],
)
def test_overlap_matches_plain_sequence_parallel(
    dist_pool: DistPool, kind: str, tp: int, fp8: bool, bias: bool
) -> None:
    results = dist_pool.run(_check_block, tp, args=(kind, tp, fp8, bias))
    amax = int(fp8)  # one scalar max all-reduce per fp8 operand held in shards over tp
    # forward: two rings of tp - 1 steps, no all-gather or reduce-scatter collective; fp8:
    # the column's gathered input and weight shard, the row's input and weight shards.
    # backward: two rings, and the all-gather that rebuilds the column input for wgrad; fp8:
    # the row's gathered output gradient, its weight (dgrad) and input (wgrad) shards, the
    # column's output-gradient and weight shards
    expected = {
        "forward": Counter(batch_isend_irecv=2 * (tp - 1), all_reduce=4 * amax),
        "backward": Counter(batch_isend_irecv=2 * (tp - 1), all_gather_into_tensor=1,
                            all_reduce=5 * amax),
    }  # fmt: skip
    for calls in results:
        assert calls == {k: +v for k, v in expected.items()}


def _check_ring_order(tp: int) -> list[str]:
    """Each transfer starts before the GEMM it overlaps and is waited only after it."""
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank, dev = dist.get_rank(g), rank_device()
    events: list[str] = []
    original = dist.batch_isend_irecv

    class _Logged:
        def __init__(self, work: Any) -> None:
            self.work = work

        def wait(self) -> None:
            events.append("wait")
            self.work.wait()

    def logged(ops: Any) -> list[Any]:
        events.append("start")
        return [_Logged(w) for w in original(ops)]

    local = torch.full((2, 3), float(rank), device=dev)
    seen: list[int] = []

    def on_chunk(source: int, chunk: Tensor) -> None:
        events.append("gemm")
        assert torch.equal(chunk, torch.full_like(chunk, float(source)))
        seen.append(source)

    def partial(dest: int) -> Tensor:
        events.append("gemm")
        return torch.full((2, 3), float(10 * dest + rank), device=dev)

    setattr(dist, "batch_isend_irecv", logged)  # noqa: B010
    try:
        full = ring_all_gather(local, g, on_chunk, keep=True)
        gathered_events = list(events)
        events.clear()
        reduced = ring_reduce_scatter(partial, g)
    finally:
        setattr(dist, "batch_isend_irecv", original)  # noqa: B010
    assert full is not None
    assert torch.equal(full, torch.arange(tp, device=dev).repeat_interleave(2)[:, None]
                       .expand(-1, 3).float())  # fmt: skip
    assert seen == [(rank - k) % tp for k in range(tp)], "local chunk first, then the ring"
    assert torch.equal(reduced, torch.full_like(reduced, float(tp * 10 * rank + sum(range(tp)))))
    return [*gathered_events, "|", *events]


@pytest.mark.parametrize("tp", [2, 3])
def test_rings_launch_each_transfer_before_the_gemm_it_hides(dist_pool: DistPool, tp: int) -> None:
    step = ["start", "gemm", "wait", "wait"]  # send and recv handles waited after the GEMM
    gather = step * (tp - 1) + ["gemm"]
    reduce = ["gemm", *step * (tp - 1)]
    for events in dist_pool.run(_check_ring_order, tp, args=(tp,)):
        assert events == [*gather, "|", *reduce]


def _errors() -> dict[str, str]:
    g2 = init_process_groups(ParallelConfig(tp=2)).tp
    g1 = init_process_groups(ParallelConfig(tp=1)).tp
    cases: dict[str, Callable[[], Any]] = {
        "no_sp": lambda: ColumnParallelLinear(8, 8, tp_group=g2, tp_comm_overlap=True),
        "tp1": lambda: RowParallelLinear(
            8, 8, tp_group=g1, sequence_parallel=True, tp_comm_overlap=True
        ),
        "te": lambda: RowParallelLinear(
            8, 8, tp_group=g2, sequence_parallel=True, tp_comm_overlap=True, backend="te"
        ),
        "functional": lambda: column_parallel_linear(
            torch.ones(2, 1, 8), torch.ones(4, 8), tp_group=g2, tp_comm_overlap=True
        ),
        "seq": lambda: RowParallelLinear(
            8, 8, tp_group=g2, sequence_parallel=True, tp_comm_overlap=True
        )(torch.ones(3, 1, 4)),
    }
    return error_messages(cases)


def test_bad_settings_fail_in_one_sentence(dist_pool: DistPool) -> None:
    messages = dist_pool.run(_errors, 2, args=())[0]
    need = r"needs sequence_parallel=True and tp > 1 \(got sequence_parallel={}, tp={}\)"
    assert re.search("ColumnParallelLinear tp_comm_overlap=True.*" + need.format(False, 2),
                     messages["no_sp"])  # fmt: skip
    assert re.search("RowParallelLinear .*" + need.format(True, 1), messages["tp1"])
    assert "not backend 'te'" in messages["te"]
    assert re.search("column_parallel_linear .*" + need.format(False, 2), messages["functional"])
    assert "sequence length (3) is not divisible by tp (2)" in messages["seq"]
    for text in messages.values():
        assert text.count(". ") == 0, text
