"""Column/Row parallel linear layers == nn.Linear on the full weights, for tp 1-4, SP on/off.

Tolerance: fp32; the parallel run sums the same products in another order (partial
sums over tp ranks, GEMMs of other shapes), so every tensor agrees with the reference to
the rounding bound of ``assert_close_to_reference``: a multiple of u · sqrt(n) · max|ref|,
with n (``N``) the longest chain of reductions behind one element. Random values are drawn
on the CPU (the same on any machine) and the reference then runs on the layers' device
(``rank_device()``), so both sides use the same kernels: CPU and GPU kernels round
differently, which this tolerance does not cover.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tp_testing import recorded_dist_calls
from torch import Tensor, nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_tp_layers import (
    ColumnParallelLinear,
    Normal,
    RowParallelLinear,
    init_full,
    mark_replicated,
    mark_sequence_parallel,
    param_generator,
    shard_spec,
    shard_tensor,
    sync_sequence_parallel_grads,
)

SEED = 11
S, B, H, FFN, HEADS = 12, 2, 24, 48, 12  # every size divisible by tp in {1, 2, 3, 4}
# Longest chain of sums behind one element: forward through the norm (H), fc1 (H) and fc2
# (FFN), back through the same, then over the S·B tokens for a weight or bias gradient
# (attention's chain, qkv H + head dim + S + proj H, is shorter).
N = 2 * (2 * H + FFN) + S * B
HEAD_DIM = H // HEADS
CASES = [(tp, sp) for tp in (1, 2, 3, 4) for sp in (False, True)]
COLLECTIVES = (
    "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather",
    "reduce_scatter", "broadcast", "all_to_all_single", "send", "recv", "isend", "irecv",
)  # fmt: skip


def count_collectives() -> AbstractContextManager[list[tuple[str, bool]]]:
    """Record (name, async_op) of every torch.distributed collective issued inside."""
    return recorded_dist_calls(COLLECTIVES, lambda name, kw: (name, bool(kw.get("async_op"))))


@contextmanager
def log_overlap() -> Iterator[list[str]]:
    """Log in order: each async collective's issue and its handle's wait, and every GEMM
    run through ``Tensor.matmul`` (as ``gemm <result shape>``).

    Only the column layer's custom backward calls ``Tensor.matmul`` (its dgrad and wgrad
    GEMMs); the row layer, GELU, norm and attention backward are autograd's own kernels,
    so a ``gemm`` of the column weight's shape is the weight-gradient GEMM.
    """
    events: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    matmul = torch.Tensor.matmul

    class _Logged:
        """A Work handle whose wait is logged."""

        def __init__(self, name: str, work: Any) -> None:
            self.name, self.work = name, work

        def wait(self, *args: Any, **kwargs: Any) -> Any:
            events.append(f"wait {self.name}")
            return self.work.wait(*args, **kwargs)

        def __getattr__(self, attr: str) -> Any:
            return getattr(self.work, attr)

    def logged(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not kwargs.get("async_op", False):
                return fn(*args, **kwargs)
            events.append(f"issue {name}")
            return _Logged(name, fn(*args, **kwargs))

        return call

    def gemm(self: Tensor, other: Tensor) -> Tensor:
        out = matmul(self, other)
        events.append(f"gemm {tuple(out.shape)}")
        return out

    for name, fn in originals.items():
        setattr(dist, name, logged(name, fn))
    setattr(torch.Tensor, "matmul", gemm)  # noqa: B010
    try:
        yield events
    finally:
        setattr(torch.Tensor, "matmul", matmul)  # noqa: B010
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _check_column_backward_overlap(events: list[str], tp: int, sp: bool, weight: Tensor) -> None:
    """The column layer's input-gradient collective is issued before its weight-gradient
    GEMM and waited only after it (under SP the input all-gather for wgrad likewise hides
    behind the dgrad GEMM); a wait moved up to the issue fails here."""
    if tp == 1:  # a plain F.linear: no collective, no custom backward
        assert events == [], f"backward ran {events}, expected nothing"
        return
    dgrad = f"gemm {(S, B, H)}"  # [s, b, out/tp] @ [out/tp, h]
    wgrad = f"gemm {tuple(weight.shape)}"  # [out/tp, s*b] @ [s*b, h]
    if sp:
        gather, scatter = "all_gather_into_tensor", "reduce_scatter_tensor"
        expected = [f"issue {gather}", dgrad, f"wait {gather}",
                    f"issue {scatter}", wgrad, f"wait {scatter}"]  # fmt: skip
    else:
        expected = [dgrad, "issue all_reduce", wgrad, "wait all_reduce"]
    assert events == expected, f"backward ran {events}, expected {expected}"


def _close(actual: Tensor, expected: Tensor, what: str) -> None:
    assert_close_to_reference(actual, expected, reduction_length=N, name=what)


def _grad(t: Tensor | None) -> Tensor:
    assert t is not None and t.grad is not None
    return t.grad


def _full(shape: tuple[int, ...], name: str, std: float = 0.3) -> Tensor:
    return init_full(shape, Normal(std), param_generator(SEED, name))


def _randn(*shape: int, device: torch.device) -> Tensor:
    """Drawn on the CPU generator (the same values on any machine), then moved to ``device``."""
    return torch.randn(*shape).to(device)


def _leaf(t: Tensor, device: torch.device) -> Tensor:
    """A fresh copy of ``t`` on ``device`` that collects a gradient (a reference input)."""
    return t.detach().to(device, copy=True).requires_grad_()


def _load(param: Tensor | None, full: Tensor) -> None:
    """Copy this rank's shard of ``full`` into ``param`` (by its shard spec)."""
    assert param is not None
    spec = shard_spec(param)
    assert spec is not None
    with torch.no_grad():
        param.copy_(shard_tensor(full, spec))


def _seq(x: Tensor, sp: bool, rank: int, tp: int) -> Tensor:
    """The activation a rank holds: its sequence slice under SP, else the whole tensor."""
    return shard_tensor(x, 0, rank, tp) if sp else x.clone()


def _check_mlp(tp: int, sp: bool) -> dict[str, list[tuple[str, bool]]]:
    """LayerNorm -> Column -> GELU -> Row (+ residual): outputs, input and weight grads."""
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank, dev = dist.get_rank(g), rank_device()
    fc1 = ColumnParallelLinear(
        H, FFN, tp_group=g, sequence_parallel=sp, init_method=Normal(0.3), seed=SEED,
        name="mlp.fc1", device=dev,
    )  # fmt: skip
    fc2 = RowParallelLinear(
        FFN, H, tp_group=g, sequence_parallel=sp, init_method=Normal(0.3), seed=SEED,
        name="mlp.fc2", device=dev,
    )  # fmt: skip
    norm = nn.LayerNorm(H, device=dev)
    w1, w2 = _full((FFN, H), "mlp.fc1.weight"), _full((H, FFN), "mlp.fc2.weight")
    # rule 2: the layers drew exactly their slice of the full weights
    assert torch.equal(fc1.weight.detach().cpu(), shard_tensor(w1, 0, rank, tp))
    assert torch.equal(fc2.weight.detach().cpu(), shard_tensor(w2, 1, rank, tp))
    w1, w2 = w1.to(dev), w2.to(dev)
    b1, b2 = _randn(FFN, device=dev), _randn(H, device=dev)
    ln_w, ln_b = _randn(H, device=dev), _randn(H, device=dev)
    _load(fc1.bias, b1)
    _load(fc2.bias, b2)
    with torch.no_grad():
        norm.weight.copy_(ln_w)
        norm.bias.copy_(ln_b)
    for p in norm.parameters():
        mark_replicated(p, g)
        if sp:
            mark_sequence_parallel(p)
    x, dy = _randn(S, B, H, device=dev), _randn(S, B, H, device=dev)

    ref = [_leaf(t, dev) for t in (x, w1, b1, w2, b2, ln_w, ln_b)]
    xr, w1r, b1r, w2r, b2r, lnwr, lnbr = ref
    hr = F.layer_norm(xr, (H,), lnwr, lnbr)
    y_ref = xr + F.linear(F.gelu(F.linear(hr, w1r, b1r)), w2r, b2r)
    y_ref.backward(dy)

    xp = _seq(x, sp, rank, tp).requires_grad_()
    with count_collectives() as forward_calls:
        y = xp + fc2(F.gelu(fc1(norm(xp))))
    with count_collectives() as backward_calls, log_overlap() as events:
        y.backward(_seq(dy, sp, rank, tp))
    sync_sequence_parallel_grads([*norm.parameters(), *fc2.parameters()], g)
    _check_column_backward_overlap(events, tp, sp, fc1.weight)

    _close(y, _seq(y_ref, sp, rank, tp), "output")
    _close(_grad(xp), _seq(_grad(xr), sp, rank, tp), "input grad")
    _close(_grad(fc1.weight), shard_tensor(_grad(w1r), 0, rank, tp), "fc1 weight grad")
    _close(_grad(fc1.bias), shard_tensor(_grad(b1r), 0, rank, tp), "fc1 bias grad")
    _close(_grad(fc2.weight), shard_tensor(_grad(w2r), 1, rank, tp), "fc2 weight grad")
    _close(_grad(fc2.bias), _grad(b2r), "fc2 bias grad")
    _close(_grad(norm.weight), _grad(lnwr), "norm weight grad")
    _close(_grad(norm.bias), _grad(lnbr), "norm bias grad")
    return {"forward": forward_calls, "backward": backward_calls}


def _attention(qkv: Tensor, heads: int) -> Tensor:
    """Causal attention on a head-major fused projection ``[s, b, heads * 3 * d]``."""
    s, b, _ = qkv.shape
    q, k, v = qkv.view(s, b, heads, 3, HEAD_DIM).permute(3, 1, 2, 0, 4).unbind(0)  # [b,n,s,d]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * HEAD_DIM)  # [s, b, n*d]


def _check_attention(tp: int, sp: bool) -> dict[str, list[tuple[str, bool]]]:
    """Fused QKV Column (whole heads per rank) -> attention -> output Row."""
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank, dev = dist.get_rank(g), rank_device()
    qkv = ColumnParallelLinear(
        H, 3 * H, tp_group=g, sequence_parallel=sp, init_method=Normal(0.3), seed=SEED,
        name="attn.qkv", device=dev,
    )  # fmt: skip
    proj = RowParallelLinear(
        H, H, tp_group=g, sequence_parallel=sp, init_method=Normal(0.3), seed=SEED,
        name="attn.proj", device=dev,
    )  # fmt: skip
    w_qkv = _full((3 * H, H), "attn.qkv.weight").to(dev)
    w_proj = _full((H, H), "attn.proj.weight").to(dev)
    b_qkv, b_proj = _randn(3 * H, device=dev), _randn(H, device=dev)
    _load(qkv.bias, b_qkv)
    _load(proj.bias, b_proj)
    x, dy = _randn(S, B, H, device=dev), _randn(S, B, H, device=dev)

    ref = [_leaf(t, dev) for t in (x, w_qkv, b_qkv, w_proj, b_proj)]
    xr, wqr, bqr, wpr, bpr = ref
    y_ref = F.linear(_attention(F.linear(xr, wqr, bqr), HEADS), wpr, bpr)
    y_ref.backward(dy)

    xp = _seq(x, sp, rank, tp).requires_grad_()
    with count_collectives() as forward_calls:
        y = proj(_attention(qkv(xp), HEADS // tp))
    with count_collectives() as backward_calls, log_overlap() as events:
        y.backward(_seq(dy, sp, rank, tp))
    sync_sequence_parallel_grads(proj.parameters(), g)
    _check_column_backward_overlap(events, tp, sp, qkv.weight)

    _close(y, _seq(y_ref, sp, rank, tp), "output")
    _close(_grad(xp), _seq(_grad(xr), sp, rank, tp), "input grad")
    _close(_grad(qkv.weight), shard_tensor(_grad(wqr), 0, rank, tp), "qkv weight grad")
    _close(_grad(qkv.bias), shard_tensor(_grad(bqr), 0, rank, tp), "qkv bias grad")
    _close(_grad(proj.weight), shard_tensor(_grad(wpr), 1, rank, tp), "proj weight grad")
    _close(_grad(proj.bias), _grad(bpr), "proj bias grad")
    return {"forward": forward_calls, "backward": backward_calls}


def _expected_calls(tp: int, sp: bool) -> dict[str, Counter[str]]:
    """Megatron's collectives for one Column -> Row block."""
    if tp == 1:
        return {"forward": Counter(), "backward": Counter()}
    if not sp:
        return {"forward": Counter(all_reduce=1), "backward": Counter(all_reduce=1)}
    # backward: all-gather of the output grad (dual of the reduce-scatter), all-gather that
    # rebuilds the column input for the weight gradient, reduce-scatter of the input grad
    return {
        "forward": Counter(all_gather_into_tensor=1, reduce_scatter_tensor=1),
        "backward": Counter(all_gather_into_tensor=2, reduce_scatter_tensor=1),
    }


@pytest.mark.parametrize("check", [_check_mlp, _check_attention], ids=["mlp", "attention"])
@pytest.mark.parametrize(
    ("tp", "sp"), CASES, ids=[f"tp{t}-{'sp' if s else 'nosp'}" for t, s in CASES]
)
def test_block_matches_single_process(
    dist_pool: DistPool, check: Callable[[int, bool], Any], tp: int, sp: bool
) -> None:
    results = dist_pool.run(check, tp, args=(tp, sp))
    expected = _expected_calls(tp, sp)
    for calls in results:
        for phase in ("forward", "backward"):
            assert Counter(name for name, _ in calls[phase]) == expected[phase], phase
        # the column layer's input-gradient collective overlaps the weight-gradient GEMM:
        # async here, and issued before / waited after that GEMM (each rank checks the
        # order itself in _check_column_backward_overlap)
        if tp > 1:
            assert calls["backward"][-1][1], "the last backward collective must be async"


def _check_column_variants(tp: int) -> None:
    """gather_output, skip_bias_add, input_is_parallel=False, bias=False."""
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank, dev = dist.get_rank(g), rank_device()
    w, bias = _full((FFN, H), "col.weight").to(dev), _randn(FFN, device=dev)
    x = _randn(S, B, H, device=dev)
    y_ref = F.linear(x, w, bias)  # the reference, on the layers' device

    gathered = ColumnParallelLinear(
        H, FFN, tp_group=g, gather_output=True, init_method=Normal(0.3), seed=SEED,
        name="col", device=dev,
    )  # fmt: skip
    _load(gathered.bias, bias)
    xg = x.clone().requires_grad_()
    out = gathered(xg)
    _close(out, y_ref, "gather_output")
    out.backward(torch.ones_like(out))
    _close(_grad(xg), torch.ones(S, B, FFN, device=dev) @ w, "gather_output input grad")

    skipped = ColumnParallelLinear(
        H, FFN, tp_group=g, skip_bias_add=True, init_method=Normal(0.3), seed=SEED,
        name="col", device=dev,
    )  # fmt: skip
    _load(skipped.bias, bias)
    out = skipped(x)
    _close(out + skipped.bias, shard_tensor(y_ref, -1, rank, tp), "skip_bias_add")
    _close(out, shard_tensor(F.linear(x, w), -1, rank, tp), "skip_bias_add leaves the bias")

    no_bias = ColumnParallelLinear(H, FFN, tp_group=g, bias=False, device=dev)
    assert no_bias.bias is None and len(list(no_bias.parameters())) == 1

    w2, b2 = _full((H, FFN), "row.weight").to(dev), _randn(H, device=dev)
    row = RowParallelLinear(
        FFN, H, tp_group=g, input_is_parallel=False, skip_bias_add=True,
        init_method=Normal(0.3), seed=SEED, name="row", device=dev,
    )  # fmt: skip
    _load(row.bias, b2)
    h = _randn(S, B, FFN, device=dev)
    hp = h.clone().requires_grad_()
    out = row(hp)
    _close(out, F.linear(h, w2), "row input_is_parallel=False, skip_bias_add")
    out.backward(torch.ones_like(out))
    _close(_grad(hp), torch.ones(S, B, H, device=dev) @ w2, "row scatter backward")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layer_options_match_single_process(dist_pool: DistPool, tp: int) -> None:
    dist_pool.run(_check_column_variants, tp, args=(tp,))


def _check_shard_metadata(tp: int) -> list[tuple[str, object]]:
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank = dist.get_rank(g)
    col = ColumnParallelLinear(H, FFN, tp_group=g, sequence_parallel=True)
    row = RowParallelLinear(FFN, H, tp_group=g, sequence_parallel=True)
    named = [*col.named_parameters("col"), *row.named_parameters("row")]
    specs = {name: shard_spec(p) for name, p in named}
    assert all(s is not None for s in specs.values())
    w_col, w_row = shard_spec(col.weight), shard_spec(row.weight)
    assert w_col is not None and w_row is not None and row.bias is not None
    assert (w_col.dim, w_col.full_shape, w_col.duplicate) == (0, (FFN, H), False)
    assert (w_row.dim, w_row.full_shape, w_row.duplicate) == (1, (H, FFN), False)
    b_row = shard_spec(row.bias)
    assert b_row is not None and b_row.dim is None and b_row.duplicate == (rank != 0)
    assert getattr(row.bias, "mega_sequence_parallel", False)
    assert not getattr(col.bias, "mega_sequence_parallel", False)
    assert all(
        s is not None and s.shard_rank == rank and s.num_shards == tp for s in specs.values()
    )
    return [(name, s) for name, s in specs.items()]


def test_every_parameter_says_how_it_is_sharded(dist_pool: DistPool) -> None:
    results = dist_pool.run(_check_shard_metadata, 2, args=(2,))
    assert [name for name, _ in results[0]] == ["col.weight", "col.bias", "row.weight", "row.bias"]
