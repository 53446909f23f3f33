"""FP8 GEMMs (emulated on CPU): quantisation bounds, exact emulation, layers at tp 1/2/4 and SP.

Tolerances come from the formats. Rounding to nearest in a format with m mantissa bits has
relative error at most u = 2^-(m+1) for values in the normal range: e4m3 (m = 3) u = 2^-4,
e5m2 (m = 2) u = 2^-3. Below the smallest normal the error is at most half the subnormal
spacing d (e4m3: d = 2^-9, e5m2: d = 2^-16), in scaled units, i.e. d/2 * amax/fp8_max in
the tensor's own units. So one element's quantisation error is bounded by
e(t) = u|t| + d/2 * amax/fp8_max, and a product-sum A @ B by
e(A) @ |B| + |A| @ e(B) + e(A) @ e(B), plus fp32 rounding of the K-term sums and of the
scalings, at most (K + 4) * 2^-24 * (|A| @ |B|) (with |A|, |B| widened by their bounds).

Against a hand-written quantise-dequantise reference with the same scales the emulation is
bit-exact (same fp32 operations on the same values). Tensor-parallel layers scale every
operand they hold in shards (a column layer's weight and output-gradient shards, a row
layer's input and weight shards) by the whole tensor's amax (one scalar max all-reduce), so
each rank quantises exactly as one process would and a tp=2 or tp=4 block (with or without
sequence parallel) equals the single-process ``fp8_linear`` block on the whole weights; in
fp32 the two differ only in the order of float sums, within the rounding bound of
``assert_close_to_reference`` (as in test_linear.py).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tp_testing import error_messages
from torch import Tensor

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_tp_layers import (
    ColumnParallelLinear,
    Fp8Recipe,
    Normal,
    RowParallelLinear,
    fp8_linear,
    fp8_linear_dgrad,
    fp8_linear_forward,
    fp8_linear_wgrad,
    init_full,
    param_generator,
    shard_spec,
    shard_tensor,
    sync_sequence_parallel_grads,
)
from mega_tp_layers.fp8 import fp8_quantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U = {E4M3: 2.0**-4, E5M2: 2.0**-3}  # half an ulp at 1: 2^-(mantissa bits + 1)
SUBNORMAL_SPACING = {E4M3: 2.0**-9, E5M2: 2.0**-16}
F32 = 2.0**-24
EMULATE = Fp8Recipe(emulate=True)
SEED = 5
# 16 tokens; every per-rank GEMM dim (tokens, H, FFN/tp) a multiple of 16 at tp 1, 2 and 4
# (under SP the GEMMs run on the gathered 16 tokens; S/tp = 2 rows per rank at tp 4)
S, B, H, FFN = 8, 2, 32, 64
# The block's longest chain of fp32 sums: fc1 (H) and fc2 (FFN), forward and back, then the
# S·B tokens of a weight gradient.
N_BLOCK = 2 * (H + FFN) + S * B


def _randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _wide_range(n: int, seed: int) -> Tensor:
    """Values over ~10 binades, both signs: some land in the subnormal range after scaling."""
    g = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return sign * torch.exp2(torch.empty(n).uniform_(-14.0, 3.0, generator=g))


def _elem_bound(t: Tensor, dtype: torch.dtype) -> Tensor:
    """Upper bound on |quantised(t) - t|, elementwise (module docstring)."""
    amax = t.abs().amax()
    return U[dtype] * t.abs() + SUBNORMAL_SPACING[dtype] / 2 * amax / torch.finfo(dtype).max


def _gemm_bound(a: Tensor, da: Tensor, b: Tensor, db: Tensor) -> Tensor:
    """Bound on |quantised GEMM - a @ b| given elementwise operand bounds da, db."""
    k = a.shape[1]
    quant = da @ b.abs() + a.abs() @ db + da @ db
    rounding = (k + 4) * F32 * ((a.abs() + da) @ (b.abs() + db))
    return quant + rounding


def _within(actual: Tensor, expected: Tensor, bound: Tensor, what: str) -> None:
    err = (actual.detach() - expected).abs()
    worst = float((err - bound).max())
    assert worst <= 0.0, f"{what}: error exceeds the fp8 bound by {worst}"
    assert float(err.max()) > 0.0, f"{what}: no quantisation error at all (not quantised?)"


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_round_trip_error_is_within_the_format_bound(dtype: torch.dtype) -> None:
    x = _wide_range(4096, seed=1)
    q = fp8_quantize(x, dtype)
    assert q.data.dtype == dtype and q.inv_scale.dtype == torch.float32 and q.inv_scale.dim() == 0
    fmax = torch.finfo(dtype).max
    assert float(q.data.float().abs().max()) == fmax  # amax maps to the top of the range
    err = (q.dequantize() - x).abs()
    # + 4 fp32 roundings (x * scale, the reciprocal, data * inv_scale, amax / fmax)
    bound = _elem_bound(x, dtype) * (1 + 4 * F32) + 4 * F32 * x.abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    normal = x.abs() * fmax / x.abs().amax() >= torch.finfo(dtype).smallest_normal
    rel = (err / x.abs())[normal]
    assert float(rel.max()) > U[dtype] / 2  # the bound is nearly attained: it is the format's
    zeros = fp8_quantize(torch.zeros(16, 16), dtype)
    assert torch.isfinite(zeros.inv_scale) and bool((zeros.dequantize() == 0).all())


def _hand_qdq(t: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Quantise by hand: fp8 values widened to fp32, and the inverse scale."""
    fmax = torch.finfo(dtype).max
    scale = fmax / t.abs().amax().clamp(min=1e-12)
    return (t * scale).clamp(-fmax, fmax).to(dtype).float(), scale.reciprocal()


def test_emulated_gemms_equal_the_hand_written_reference_exactly() -> None:
    m, k, n = 32, 48, 64
    x, w, g = _randn(m, k, seed=2), _randn(n, k, seed=3) * 0.05, _randn(m, n, seed=4) * 1e-3
    qx, ix = _hand_qdq(x, E4M3)
    qw, iw = _hand_qdq(w, E4M3)
    qg, ig = _hand_qdq(g, E5M2)
    assert torch.equal(fp8_linear_forward(x, w, EMULATE), (qx @ qw.t()) * (ix * iw))
    assert torch.equal(fp8_linear_dgrad(g, w, EMULATE), (qg @ qw) * (ig * iw))
    assert torch.equal(fp8_linear_wgrad(g, x, EMULATE), (qg.t() @ qx) * (ig * ix))
    pre = fp8_quantize(g, E5M2)  # an already quantised gradient gives the same result
    assert torch.equal(fp8_linear_dgrad(pre, w, EMULATE), (qg @ qw) * (ig * iw))
    out = fp8_linear_forward(x.bfloat16(), w.bfloat16(), EMULATE)
    assert out.dtype == torch.bfloat16


def test_backward_reuses_the_forward_quantisation(monkeypatch: pytest.MonkeyPatch) -> None:
    import mega_tp_layers.fp8 as fp8_module

    m, k, n = 32, 48, 64
    x, w, g = _randn(m, k, seed=2), _randn(n, k, seed=3) * 0.05, _randn(m, n, seed=4) * 1e-3
    qx, ix = _hand_qdq(x, E4M3)
    qw, iw = _hand_qdq(w, E4M3)
    qg, ig = _hand_qdq(g, E5M2)
    calls: list[torch.dtype] = []
    real = fp8_module.fp8_quantize

    def counting(t: Tensor, dtype: torch.dtype, eps: float = 1e-12, group: Any = None) -> Any:
        calls.append(dtype)
        return real(t, dtype, eps, group)

    monkeypatch.setattr(fp8_module, "fp8_quantize", counting)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xr, wr, recipe=EMULATE)
    y.backward(g)
    assert xr.grad is not None and wr.grad is not None
    assert torch.equal(y, (qx @ qw.t()) * (ix * iw))
    assert torch.equal(xr.grad, (qg @ qw) * (ig * iw))  # the forward's fp8 weight
    assert torch.equal(wr.grad, (qg.t() @ qx) * (ig * ix))  # the forward's fp8 input
    assert calls == [E4M3, E4M3, E5M2]  # x and w in forward, the gradient once in backward


def test_fp8_linear_matches_fp32_within_the_format_bounds() -> None:
    x, w, b = _randn(S, B, H, seed=6), _randn(FFN, H, seed=7) * 0.2, _randn(FFN, seed=8)
    dy = _randn(S, B, FFN, seed=9)
    x8, w8, b8 = (t.clone().requires_grad_() for t in (x, w, b))
    y8 = fp8_linear(x8, w8, b8, recipe=EMULATE)
    y8.backward(dy)
    x2d, dy2d = x.reshape(-1, H), dy.reshape(-1, FFN)
    ex, ew, eg = _elem_bound(x2d, E4M3), _elem_bound(w, E4M3), _elem_bound(dy2d, E5M2)
    wt, ewt = w.t(), ew.t()
    _within(y8.reshape(-1, FFN), x2d @ wt + b, _gemm_bound(x2d, ex, wt, ewt), "forward")
    assert x8.grad is not None and w8.grad is not None and b8.grad is not None
    _within(x8.grad.reshape(-1, H), dy2d @ w, _gemm_bound(dy2d, eg, w, ew), "dgrad")
    _within(w8.grad, dy2d.t() @ x2d, _gemm_bound(dy2d.t(), eg.t(), x2d, ex), "wgrad")
    assert_close_to_reference(b8.grad, dy2d.sum(0), reduction_length=S * B, name="bias (fp32)")


def test_unaligned_gemm_falls_back_to_high_precision_with_a_warning() -> None:
    x, w = _randn(3, H, seed=10), _randn(FFN, H, seed=11)  # 3 tokens: not a multiple of 16
    with pytest.warns(UserWarning, match=r"not a multiple of 16.*high precision"):
        out = fp8_linear_forward(x, w, EMULATE)
    assert_close_to_reference(out, x @ w.t(), reduction_length=H, name="fallback GEMM")


@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
def test_compiles_without_graph_breaks(scaling: str) -> None:
    """Compiled (AOTAutograd's graphs, run eagerly) equals eager, gradients included: under
    torch 2.11 a GEMM result returned through a no-op ``.to`` or summed in place reached
    the backward as zeros (dx and dw all zero), which this caught there."""
    recipe = Fp8Recipe(emulate=True, scaling=scaling)  # type: ignore[arg-type]
    x, w = _randn(16, H, seed=12), _randn(FFN, H, seed=13)

    def step(x: Tensor, w: Tensor) -> Tensor:
        y = fp8_linear(x, w, recipe=recipe)
        y.square().sum().backward()
        return y

    eager_x, eager_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    expected = step(eager_x, eager_w)
    cx, cw = x.clone().requires_grad_(), w.clone().requires_grad_()
    compiled = torch.compile(
        lambda x, w: fp8_linear(x, w, recipe=recipe), backend="aot_eager", fullgraph=True
    )
    y = compiled(cx, cw)
    y.square().sum().backward()
    torch._dynamo.reset()
    assert torch.equal(y, expected)
    for name, got, want in (("x", cx.grad, eager_x.grad), ("w", cw.grad, eager_w.grad)):
        assert got is not None and want is not None and bool(want.abs().sum() > 0), name
        assert torch.equal(got, want), f"{scaling}: the compiled gradient of {name} differs"


# ---- layers: tp 1, 2 and 4, sequence parallel, against one process ---------------------


def _full(shape: tuple[int, ...], name: str) -> Tensor:
    return init_full(shape, Normal(0.3), param_generator(SEED, name))


def _check_block(tp: int, sp: bool) -> None:
    """Column (fp8) -> GELU -> Row (fp8) at tp == the same block in one process, fwd and bwd.

    Every operand held in shards over tp is scaled by the whole tensor's amax, so each rank
    quantises exactly as one process does; what remains is fp32 summation order.
    """
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank, dev = dist.get_rank(g), rank_device()
    common: dict[str, Any] = {"tp_group": g, "sequence_parallel": sp, "init_method": Normal(0.3),
                              "seed": SEED, "device": dev, "fp8": EMULATE}  # fmt: skip
    fc1 = ColumnParallelLinear(H, FFN, name="fc1", **common)
    fc2 = RowParallelLinear(FFN, H, name="fc2", **common)
    w1, w2 = _full((FFN, H), "fc1.weight").to(dev), _full((H, FFN), "fc2.weight").to(dev)
    b1, b2 = _randn(FFN, seed=20).to(dev), _randn(H, seed=21).to(dev)
    for param, full in ((fc1.bias, b1), (fc2.bias, b2)):
        assert param is not None
        spec = shard_spec(param)
        assert spec is not None
        with torch.no_grad():
            param.copy_(shard_tensor(full, spec))
    x, dy = _randn(S, B, H, seed=22).to(dev), _randn(S, B, H, seed=23).to(dev)

    # the reference: one process, the whole weights through fp8_linear
    xr, w1r, b1r, w2r = (t.clone().requires_grad_() for t in (x, w1, b1, w2))
    y_ref = fp8_linear(F.gelu(fp8_linear(xr, w1r, b1r, recipe=EMULATE)), w2r, recipe=EMULATE) + b2
    y_ref.backward(dy)
    assert w1r.grad is not None and b1r.grad is not None and w2r.grad is not None

    def seq(t: Tensor) -> Tensor:
        return shard_tensor(t, 0, rank, tp) if sp else t

    xp = seq(x).clone().requires_grad_()
    y = fc2(F.gelu(fc1(xp)))
    y.backward(seq(dy))

    def close(actual: Tensor | None, expected: Tensor | None, what: str) -> None:
        assert actual is not None and expected is not None
        assert_close_to_reference(actual, expected, reduction_length=N_BLOCK, name=what)

    close(y, seq(y_ref), "output")
    close(xp.grad, seq(xr.grad) if xr.grad is not None else None, "input grad")
    close(fc1.weight.grad, shard_tensor(w1r.grad, 0, rank, tp), "fc1 weight grad")
    close(fc1.bias.grad if fc1.bias is not None else None, shard_tensor(b1r.grad, 0, rank, tp),
          "fc1 bias grad")  # fmt: skip
    close(fc2.weight.grad, shard_tensor(w2r.grad, 1, rank, tp), "fc2 weight grad")
    # under SP each rank's fc2 bias gradient covers its own sequence slice: the sync sums it
    # over tp (fc2.bias is the only marked parameter; nothing is marked without SP)
    synced = sync_sequence_parallel_grads([*fc1.parameters(), *fc2.parameters()], g)
    assert synced == (1 if sp and tp > 1 else 0), synced
    assert fc2.bias is not None
    # the bias is added outside the fp8 GEMMs: its gradient is an fp32 sum over the tokens
    close(fc2.bias.grad, dy.reshape(-1, H).sum(0), "fc2 bias grad")
    if tp > 1:  # the shards' own amax differ: one-process results need the reduced one
        amax = fc1.weight.detach().abs().amax().reshape(1)
        gathered = [torch.empty_like(amax) for _ in range(tp)]
        dist.all_gather(gathered, amax, group=g)
        assert len({float(a) for a in gathered}) == tp


CASES = [(1, False), (2, False), (2, True), (4, False), (4, True)]


@pytest.mark.parametrize(("tp", "sp"), CASES, ids=[f"tp{t}{'-sp' if s else ''}" for t, s in CASES])
def test_fp8_block_matches_one_process(dist_pool: DistPool, tp: int, sp: bool) -> None:
    """A tp-parallel fp8 block == the one-process ``fp8_linear`` block (see ``_check_block``).

    At tp = 1 the layers run ``fp8_linear`` themselves, so this case compares ``fp8_linear``
    with itself: it checks the layers' wiring (weights, biases, shapes) only. The fp8
    numerics are covered by the hand-written quantise-dequantise tests above
    (``test_emulated_gemms_equal_the_hand_written_reference_exactly``,
    ``test_backward_reuses_the_forward_quantisation``) and the format bounds.
    """
    dist_pool.run(_check_block, tp, args=(tp, sp))


# ---- bad input: one sentence naming the values and the way out ----------------------------


def _layer_errors() -> dict[str, str]:
    g = init_process_groups(ParallelConfig(tp=2)).tp
    bad_recipe: Any = "e4m3"
    cases: dict[str, Any] = {
        "col_dims": lambda: ColumnParallelLinear(24, FFN, tp_group=g, fp8=EMULATE),
        "col_shard": lambda: ColumnParallelLinear(H, 48, tp_group=g, fp8=EMULATE),
        "row_shard": lambda: RowParallelLinear(48, H, tp_group=g, fp8=EMULATE),
        "te": lambda: ColumnParallelLinear(H, FFN, tp_group=g, fp8=EMULATE, backend="te"),
        "not_recipe": lambda: RowParallelLinear(FFN, H, tp_group=g, fp8=bad_recipe),
    }
    return error_messages(cases)


def test_layers_reject_bad_fp8_settings(dist_pool: DistPool) -> None:
    messages = dist_pool.run(_layer_errors, 2, args=())[0]
    assert re.search(r"in_features \(24\) to be multiples of 16", messages["col_dims"])
    assert re.search(r"out_features/tp \(24\) to be multiples of 16", messages["col_shard"])
    assert re.search(r"in_features/tp \(24\) to be multiples of 16", messages["row_shard"])
    assert "not backend 'te'" in messages["te"]
    assert "must be an Fp8Recipe or None" in messages["not_recipe"]


@pytest.mark.parametrize(
    ("build", "pattern"),
    [
        (
            lambda: Fp8Recipe(fwd_dtype=torch.bfloat16),
            r"fwd_dtype \(torch.bfloat16\) is not an fp8",
        ),
        (lambda: Fp8Recipe(fwd_dtype=E5M2), r"both torch.float8_e5m2"),
        (lambda: Fp8Recipe(eps=0.0), r"eps \(0.0\) must be a positive"),
        (lambda: Fp8Recipe(fast_accum_forward=1), r"fast_accum_forward \(1\) must be True or"),
        (
            lambda: fp8_quantize(torch.ones(4), torch.float16),
            r"dtype \(torch.float16\) is not an fp8",
        ),
        (
            lambda: fp8_linear_forward(torch.ones(16, 32), torch.ones(16, 48), EMULATE),
            r"shapes \(16, 32\) and \(16, 48\)",
        ),
        (
            lambda: fp8_linear_forward(torch.ones(16, 32).to(E4M3), torch.ones(16, 32), EMULATE),
            r"first operand has dtype torch.float8_e4m3fn",
        ),
        (
            lambda: fp8_linear(torch.ones(4, 32), torch.ones(16, 48), recipe=EMULATE),
            r"shapes \(4, 32\) and \(16, 48\)",
        ),
        (
            lambda: fp8_linear_forward(
                torch.ones(16, 32), torch.ones(16, 32), Fp8Recipe(emulate=False)
            ),
            r"compute capability 8.9 or newer.*on cpu",
        ),
    ],
    ids=[
        "dtype",
        "e5m2-pair",
        "eps",
        "fast-accum",
        "quantize-dtype",
        "shapes",
        "fp8-input",
        "linear",
        "no-gpu",
    ],
)
def test_bad_input_raises_one_sentence(build: Any, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern) as info:
        build()
    assert str(info.value).count(". ") == 0


@pytest.mark.parametrize("fast", [True, False])
def test_only_the_forward_gemm_accumulates_fast(
    monkeypatch: pytest.MonkeyPatch, fast: bool
) -> None:
    """``torch._scaled_mm`` gets ``use_fast_accum`` for the forward GEMM alone (the recipe's
    choice); dgrad and wgrad keep the precise accumulation. The GEMM is faked on the CPU by
    the exact emulation, so the values still equal the emulated layer's."""
    import mega_tp_layers.fp8_gemm as fp8_gemm

    calls: list[bool] = []

    def fake_scaled_mm(a: Tensor, b: Tensor, **kw: Any) -> Tensor:
        calls.append(kw["use_fast_accum"])
        acc = a.float() @ b.float()
        return (acc * (kw["scale_a"] * kw["scale_b"])).to(kw["out_dtype"])

    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    monkeypatch.setattr(fp8_gemm, "fp8_gemm_supported", lambda device: True)  # scaled_gemm's
    recipe = Fp8Recipe(emulate=False, fast_accum_forward=fast)
    x = _randn(16, 32, seed=1).requires_grad_()
    w = _randn(48, 32, seed=2).requires_grad_()
    out = fp8_linear(x, w, recipe=recipe)
    out.backward(_randn(16, 48, seed=3))
    assert calls == [fast, False, False]  # forward, dgrad, wgrad
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = fp8_linear(x2, w2, recipe=EMULATE)
    ref.backward(_randn(16, 48, seed=3))
    assert torch.equal(out, ref)
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)  # type: ignore[arg-type]
