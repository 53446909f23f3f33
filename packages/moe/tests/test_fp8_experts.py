"""FP8 grouped experts (``GroupedMLP(fp8=True)``, ``MoEConfig(expert_fp8=True)``).

What is checked, and the bound of each:

- one fp8 grouped linear against the exact product of its unquantised operands. Each
  operand value ``a`` is stored to within ``b_a = |a| 2^-4 + unit_a 2^-10`` (test_fp8_rows),
  so ``|a'b' - ab| <= |a| b_b + |b| b_a + b_a b_b`` and a dot product's error is at most the
  sum of those over its terms, plus fp32's rounding of the sum (``K 2^-24`` of its terms'
  magnitudes). The forward quantises ``x`` and the weight's rows; the input gradient the
  output gradient and the weight's columns; the weight gradient takes the unquantised
  operands, so it equals the bf16 layer's up to fp32 rounding;
- the weight gradient's three routes (``.grad``, straight into ``main_grad``, a
  zero-bubble W pass) against each other, eager and compiled: the same fp8 arithmetic,
  summed in another order (``assert_close_to_reference`` over the experts' chain of sums);
- the weights quantised once a step (stale until invalidated, fresh after);
- ep and etp against one process. The inputs are multiples of 2^-4 and the weights of
  2^-6, small enough that the first GEMM is exact in fp32 in any order, so each layout
  quantises the same values; after the last quantisation only fp32 reordering differs;
- the layer compiled whole on CPU, and clear errors for what cannot run.
"""

from __future__ import annotations

from contextlib import nullcontext
from itertools import pairwise

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from mega_moe import GroupedMLP, MoEConfig, MoELayer, RouterConfig
from mega_moe._fp8_grouped import fp8_grouped_linear, fp8_grouped_mm
from mega_moe.fp8_expert_weights import Fp8ExpertWeights
from mega_moe.fp8_rows import Fp8Rows, padded_rows, quantize_rows
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference
from mega_tp_layers import defer_weight_grads, invalidate_fp8_weight_caches
from mega_zero_optim import DistributedDataParallel

H, FFN, E = 32, 48, 4
COUNTS = [7, 0, 20, 5]  # an empty expert, blocks below and above one 16-row block
M = sum(COUNTS)
N = 2 * (H + FFN) + M  # the experts' chain of sums (see test_wgrad_into_main_grad)


def _element_bound(t: Tensor) -> Tensor:
    unit = t.abs().amax(dim=-1, keepdim=True) / 448.0
    return t.abs() * 2.0**-4 + unit * 2.0**-10


def _product_bound(a: Tensor, w: Tensor) -> Tensor:
    """``[M, N]``: the most ``a' @ w'^T`` can differ from ``a @ w^T`` (``a`` quantised per
    row, ``w [N, K]`` per row; fp32 accumulation over K)."""
    ba, bw = _element_bound(a).double(), _element_bound(w).double()
    a64, w64 = a.abs().double(), w.abs().double()
    quant = a64 @ bw.t() + ba @ w64.t() + ba @ bw.t()
    return quant + a.shape[1] * 2.0**-24 * ((a64 + ba) @ (w64 + bw).t())


def _blocks(t: Tensor) -> list[Tensor]:
    return list(torch.split(t, COUNTS))


def test_one_linear_is_within_the_e4m3_bound() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, H, generator=gen).requires_grad_()
    weight = (torch.randn(E, FFN, H, generator=gen) * 0.1).requires_grad_()
    cache = Fp8ExpertWeights((E, FFN, H))
    out = fp8_grouped_linear(
        x, weight, COUNTS, cache.quantized(weight.detach()), param=weight, use_grouped_mm=False
    )
    dy = torch.randn(M, FFN, generator=gen)
    out.backward(dy)
    assert x.grad is not None and weight.grad is not None
    for e, (xb, ob, db, gb) in enumerate(
        zip(_blocks(x.detach()), _blocks(out.detach()), _blocks(dy), _blocks(x.grad), strict=True)
    ):
        w = weight.detach()[e]
        exact = xb.double() @ w.double().t()
        assert bool(((ob.double() - exact).abs() <= _product_bound(xb, w)).all()), f"fwd {e}"
        exact_dx = db.double() @ w.double()
        bound = _product_bound(db, w.t().contiguous())
        assert bool(((gb.double() - exact_dx).abs() <= bound).all()), f"dgrad {e}"
        wgrad = db.double().t() @ xb.double()  # unquantised operands
        assert_close_to_reference(weight.grad[e], wgrad.float(), reduction_length=M,
                                  name=f"wgrad {e}")  # fmt: skip
    # a bound that holds for any quantiser is no test: the fp8 result is not the exact one
    assert not torch.allclose(out.detach(), torch.cat([
        xb @ weight.detach()[e].t() for e, xb in enumerate(_blocks(x.detach()))
    ]), rtol=1e-4, atol=1e-4)  # fmt: skip


def test_weights_are_quantised_once_a_step() -> None:
    mlp = GroupedMLP(H, FFN, E, seed=1, fp8=True)
    x = torch.randn(M, H)
    first = mlp(x, COUNTS)
    assert mlp.fp8_weight1 is not None and mlp.fp8_weight1.valid
    with torch.no_grad():
        mlp.weight2.mul_(2.0)
    assert torch.equal(mlp(x, COUNTS), first), "the step's cached weights are read"
    invalidate_fp8_weight_caches([mlp])
    assert torch.allclose(mlp(x, COUNTS), 2 * first, rtol=2.0**-3)  # fresh: doubled
    mlp.to(torch.bfloat16)  # a cast keeps the cache in e4m3 and empties it
    assert mlp.fp8_weight1.data.dtype == torch.float8_e4m3fn and not mlp.fp8_weight1.valid


# the weight gradient's routes ---------------------------------------------------------


def _grads(route: str, compiled: bool, device_counts: bool) -> dict[str, Tensor]:
    """Two micro-batches; the gradients as ``route`` delivers them."""
    groups = init_process_groups(ParallelConfig())
    mlp = GroupedMLP(H, FFN, E, seed=2, fp8=True)
    ddp = None
    if route != "grad":
        ddp = DistributedDataParallel(mlp, dp_group=groups.dp, use_distributed_optimizer=False,
                                      wgrad_into_main_grad=route == "main")  # fmt: skip
        ddp.zero_grad_buffer()
    forward = torch.compile(mlp, fullgraph=True) if compiled else mlp
    gen = torch.Generator().manual_seed(3)
    counts: list[int] | Tensor = torch.tensor(COUNTS) if device_counts else COUNTS
    for micro in range(2):
        x = torch.randn(M, H, generator=gen).requires_grad_()
        dy = torch.randn(M, H, generator=gen)
        invalidate_fp8_weight_caches([mlp])
        with ddp.no_sync() if ddp is not None and micro == 0 else nullcontext():
            with defer_weight_grads() if route == "split" else nullcontext() as store:
                out = forward(x, counts)
            out.backward(dy)
            if store is not None:
                store.run()
    if ddp is not None:
        ddp.finish_grad_sync()
        return {n: p.main_grad.clone() for n, p in mlp.named_parameters()}
    return {n: p.grad.clone() for n, p in mlp.named_parameters() if p.grad is not None}


def _routes(compiled: bool, device_counts: bool) -> None:
    routes = ("main", "plain") if compiled else ("main", "plain", "split")  # as bf16's tests
    grads = {r: _grads(r, compiled, device_counts) for r in ("grad", *routes)}
    for route in routes:
        for name, expected in grads["grad"].items():
            assert_close_to_reference(grads[route][name], expected, reduction_length=N,
                                      name=f"{route} {name}")  # fmt: skip
    assert torch.count_nonzero(grads["main"]["weight1"][1]) == 0  # expert 1 had no tokens


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("device_counts", [False, True], ids=["host", "device"])
def test_weight_gradient_routes_agree(
    dist_pool: DistPool, compiled: bool, device_counts: bool
) -> None:
    dist_pool.run(_routes, 1, (compiled, device_counts))


# ep and etp against one process -------------------------------------------------------


def _dyadic(shape: tuple[int, ...], step: float, gen: torch.Generator) -> Tensor:
    return torch.randint(-8, 9, shape, generator=gen).float() * step


def _solo_and_data() -> tuple[GroupedMLP, Tensor, Tensor]:
    mlp = GroupedMLP(H, FFN, E, seed=4, fp8=True)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        mlp.weight1.copy_(_dyadic(tuple(mlp.weight1.shape), 2.0**-6, gen))
        mlp.weight2.copy_(_dyadic(tuple(mlp.weight2.shape), 2.0**-6, gen))
    return mlp, _dyadic((M, H), 2.0**-4, gen), _dyadic((M, H), 2.0**-4, gen)


def _layout_case(ep: int, etp: int) -> None:
    groups = init_process_groups(ParallelConfig(ep=ep, etp=etp))
    solo, x, dy = _solo_and_data()
    x_solo = x.clone().requires_grad_()
    solo(x_solo, COUNTS).backward(dy)
    mlp = GroupedMLP(H, FFN, E, seed=4, fp8=True, ep_group=groups.ep, etp_group=groups.etp)
    local, ep_rank, etp_rank = E // ep, groups.rank("ep"), groups.rank("etp")
    first = ep_rank * local
    with torch.no_grad():  # this rank's slice of the solo layer's weights
        w1 = solo.weight1.detach()[first : first + local]
        mlp.weight1.copy_(w1.chunk(etp, dim=2)[etp_rank])
        w2 = solo.weight2.detach()[first : first + local]
        mlp.weight2.copy_(w2.chunk(etp, dim=2)[etp_rank])
    start = sum(COUNTS[:first])
    rows = slice(start, start + sum(COUNTS[first : first + local]))
    x_mine = x[rows].clone().requires_grad_()
    out = mlp(x_mine, COUNTS[first : first + local])
    out.backward(dy[rows])
    assert x_mine.grad is not None and x_solo.grad is not None
    total, grad_x = out.detach().clone(), x_mine.grad.clone()
    dist.all_reduce(total, group=groups.etp)  # partial sums over etp
    dist.all_reduce(grad_x, group=groups.etp)
    expected = solo(x, COUNTS).detach()[rows]
    assert_close_to_reference(total, expected, reduction_length=N, name="output")
    assert_close_to_reference(grad_x, x_solo.grad[rows], reduction_length=N, name="input grad")
    for name in ("weight1", "weight2"):
        got, full = getattr(mlp, name).grad, getattr(solo, name).grad
        assert got is not None and full is not None
        want = full[first : first + local].chunk(etp, dim=2)[etp_rank]
        assert_close_to_reference(got, want, reduction_length=N, name=f"{name} grad")


@pytest.mark.parametrize(("ep", "etp"), [(2, 1), (1, 2), (2, 2)])
def test_fp8_experts_over_ep_and_etp_match_one_process(
    dist_pool: DistPool, ep: int, etp: int
) -> None:
    dist_pool.run(_layout_case, ep * etp, (ep, etp))


# the MoE layer compiled, and what cannot run ------------------------------------------


def _moe(fp8: bool) -> MoELayer:
    config = MoEConfig(router=RouterConfig(num_experts=E, top_k=2), ffn_hidden_size=FFN,
                       expert_fp8=fp8)  # fmt: skip
    return MoELayer(H, config, seed=8)


def test_moe_layer_with_fp8_experts_compiles_whole() -> None:
    """Compiled fp32 arithmetic may round a value to the other side of an e4m3 boundary, so
    compiled and eager fp8 are held to the fp8 layer's own distance from the fp32 layer:
    the compiled one may be at most twice as far from it as the eager one is."""
    torch.manual_seed(0)
    x = torch.randn(8, 2, H)
    plain, eager = _moe(False), _moe(True)
    compiled = torch.compile(_moe(True), fullgraph=True)
    outs = []
    for layer in (plain, eager, compiled):
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.square().sum().backward()
        assert xi.grad is not None
        outs.append((out.detach(), xi.grad))
    for i, what in enumerate(("output", "input grad")):
        reference, eager_t, compiled_t = (o[i] for o in outs)
        distance = (eager_t - reference).abs().max()
        assert distance > 0, f"{what}: the fp8 experts did not run in fp8"
        assert (compiled_t - reference).abs().max() <= 2 * distance, what


def test_expert_fp8_needs_grouped_experts() -> None:
    with pytest.raises(ValueError, match=r"expert_fp8 runs the grouped experts.*'sequential'"):
        MoEConfig(router=RouterConfig(num_experts=E, top_k=2), ffn_hidden_size=FFN,
                  experts="sequential", expert_fp8=True)  # fmt: skip


def test_weight_cache_rejects_another_shape() -> None:
    cache = Fp8ExpertWeights((E, FFN, H))
    with pytest.raises(
        ValueError, match=r"holds a weight of shape \(4, 48, 32\), got \(4, 32, 48\)"
    ):
        cache.quantized(torch.zeros(E, H, FFN))


def _needs_sm90() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._scaled_grouped_mm needs sm90+")


def test_scaled_grouped_mm_matches_the_emulation_on_cuda() -> None:
    """``torch._scaled_grouped_mm`` against the same fp8 values and scales widened to fp32
    on the CPU, through the padded layout of router-like counts. They differ by the order
    of the K-term sums and by the GEMM's fast accumulation (Hopper's fp8 tensor cores keep
    ~22 bits between promotions: 2^-20 of the terms' magnitudes a sum, bounded by K of
    them), then the bf16 rounding of the result (2^-8 of it)."""
    _needs_sm90()
    gen = torch.Generator().manual_seed(9)
    counts, k, n = [300, 0, 129, 77], 704, 1408
    m = sum(counts)
    layout = padded_rows(torch.tensor(counts, device="cuda"), m, torch.device("cuda"))
    a = layout.scatter(quantize_rows(torch.randn(m, k, generator=gen).cuda()))
    b = quantize_rows(torch.randn(4, n, k, generator=gen).cuda() * 0.02)
    got = fp8_grouped_mm(a, b, layout.ends, torch.bfloat16).float().cpu()
    cpu_a, cpu_b = Fp8Rows(*(t.cpu() for t in a)), Fp8Rows(*(t.cpu() for t in b))
    want = fp8_grouped_mm(cpu_a, cpu_b, layout.ends.cpu(), torch.float32)
    ends = [0, *layout.ends.tolist()]
    terms = torch.cat([cpu_a.dequantize()[s:e].abs() @ cpu_b.dequantize()[g].abs().t()
                       for g, (s, e) in enumerate(pairwise(ends))])  # fmt: skip
    bound = want.abs() * 2.0**-8 + k * 2.0**-20 * terms
    rows = layout.dest.cpu().tolist()  # the real rows only
    err = (got - want).abs()[rows]
    assert bool((err <= bound[rows]).all()), float((err / bound[rows]).max())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_layer_on_cuda_is_near_the_bf16_layer(compiled: bool) -> None:
    """The whole fp8 layer on the GPU, eager and compiled, beside the bf16 layer with the
    same weights. Between the layer's GEMMs a bf16 rounding can move a value across an
    e4m3 boundary, so eager and compiled fp8 differ by whole fp8 steps in places: each is
    held to the fp8 error itself (within 2^-3 of the bf16 layer's largest value, what two
    operands at 2^-4 give), and compiled to at most twice eager's distance."""
    _needs_sm90()
    counts = torch.tensor([300, 0, 129, 77], device="cuda")
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(int(counts.sum()), 256, generator=gen).cuda().bfloat16()
    dy = torch.randn(int(counts.sum()), 256, generator=gen).cuda().bfloat16()
    results = []
    for fp8, compile_ in ((False, False), (True, False), (True, compiled)):
        mlp = GroupedMLP(256, 384, 4, seed=5, fp8=fp8, dtype=torch.bfloat16, device="cuda")
        run = torch.compile(mlp, fullgraph=True) if compile_ else mlp
        xi = x.clone().requires_grad_()
        out = run(xi, counts)
        out.backward(dy)
        assert xi.grad is not None and mlp.weight1.grad is not None
        results.append((out.float(), xi.grad.float(), mlp.weight1.grad.float()))
    for i, what in enumerate(("output", "input grad", "weight1 grad")):
        ref, eager, other = (r[i] for r in results)
        distance = float((eager - ref).abs().max())
        assert 0 < distance <= 2.0**-3 * float(ref.abs().max()), (what, distance)
        assert float((other - ref).abs().max()) <= 2 * distance, what


# the dispatcher's aligned layout (one rank, dropless) -----------------------------------


def test_aligned_dispatch_computes_what_the_unaligned_one_does() -> None:
    """The MoE layer with its tokens laid out at 16-row multiples by the dispatcher (gaps
    of zero rows) against the plain layout, fp32 experts: the same sums in another
    order (the chain of test_wgrad_into_main_grad's N, over the layer's tokens)."""
    torch.manual_seed(1)
    x = torch.randn(8, 2, H)
    results = []
    for align in (1, 16):
        layer = _moe(False)
        layer.dispatcher.row_align = align
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.square().sum().backward()
        assert xi.grad is not None
        grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
        results.append((out.detach(), xi.grad, grads))
    (out1, gx1, g1), (out16, gx16, g16) = results
    assert_close_to_reference(out16, out1, reduction_length=N, name="output")
    assert_close_to_reference(gx16, gx1, reduction_length=N, name="input grad")
    assert set(g1) == set(g16)
    for name, grad in g1.items():
        assert_close_to_reference(g16[name], grad, reduction_length=N, name=name)


def test_fp8_layer_takes_the_aligned_layout_alone_and_pads_otherwise() -> None:
    layer = _moe(True)
    tokens = torch.randn(16, H)
    routing = layer.router(tokens.view(8, 2, H))
    dispatched = layer.dispatcher.dispatch(tokens, routing)
    assert dispatched.aligned
    counts = dispatched.counts
    assert isinstance(counts, Tensor) and bool((counts % 16 == 0).all())
    assert int(counts.sum()) == dispatched.tokens.shape[0] >= 16 * 2
    assert not _moe(False).dispatcher.dispatch(tokens, routing).aligned


def test_aligned_fp8_experts_equal_the_padding_ones() -> None:
    """The fp8 experts on rows the dispatcher aligned against the same rows unaligned
    (padded inside the GEMMs): dyadic data, so each quantises the same values."""
    solo, x, dy = _solo_and_data()
    plain_x = x.clone().requires_grad_()
    plain = solo(plain_x, COUNTS)
    plain.backward(dy)
    layout = padded_rows(COUNTS, M, torch.device("cpu"))
    assert layout.dest is not None
    ends = layout.ends.tolist()
    sizes = torch.tensor([ends[0], *(b - a for a, b in pairwise(ends))])
    padded_x = torch.zeros(layout.capacity, H).index_copy(0, layout.dest, x).requires_grad_()
    padded_dy = torch.zeros(layout.capacity, H).index_copy(0, layout.dest, dy)
    grads = {n: p.grad.clone() for n, p in solo.named_parameters() if p.grad is not None}
    solo.zero_grad()
    out = solo(padded_x, sizes, aligned=True)
    out.backward(padded_dy)
    assert padded_x.grad is not None and plain_x.grad is not None
    assert_close_to_reference(out.detach()[layout.dest], plain.detach(), reduction_length=N,
                              name="output")  # fmt: skip
    assert_close_to_reference(padded_x.grad[layout.dest], plain_x.grad, reduction_length=N,
                              name="input grad")  # fmt: skip
    for name, grad in grads.items():
        got = getattr(solo, name).grad
        assert_close_to_reference(got, grad, reduction_length=N, name=name)


def test_aligned_rows_refuse_unaligned_host_counts() -> None:
    mlp = GroupedMLP(H, FFN, E, seed=1, fp8=True)
    with pytest.raises(ValueError, match=r"aligned expert rows need every count to be a "
                       r"multiple of 16, got \[7, 0, 20, 5\]; pass aligned=False"):  # fmt: skip
        mlp(torch.randn(M, H), COUNTS, aligned=True)
