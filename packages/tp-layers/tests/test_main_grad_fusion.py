"""The linears' weight gradients added straight into the wrapper's fp32 ``main_grad`` == through
``.grad``.

``addmm_into_main_grad`` against the fp64 product; then a column -> GELU -> row block built with
``wgrad_fusion=True`` under mega-zero-optim's ``DistributedDataParallel`` (tp 1 and 2, with
and without sequence parallel, dp 1 and 2, fp32, two micro-batches a step): the ``main_grad``
the fused backward fills equals the one the wrapper fills from ``.grad``
(``wgrad_into_main_grad=False``), eager, compiled and with the weight gradients deferred to
a W pass, and at tp 1 the single-process gradient. What is never offered: a tied weight, a
layer with fp8, a ZeRO-2 wrapper.

Tolerances. The accumulation: each element of ``dy^T x`` is a dot product over the ``M``
rows, each product exact in fp64, summed in fp32 and added to ``main``: the bound of
``assert_close_to_reference`` for n = M + 1 at the scale of ``sum |dy||x| + |main|``. The
block: a weight gradient's element sums the step's tokens (two micro-batches of every dp
rank's ``S * B``), after the chain that made its operands (fc2's H and fc1's FFN terms):
n = ``N`` below.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference
from mega_tp_layers import (
    MAIN_GRAD_ALPHA_ATTR,
    WGRAD_FUSION_ATTR,
    ColumnParallelLinear,
    Fp8Recipe,
    Normal,
    RowParallelLinear,
    column_parallel_linear,
    defer_weight_grads,
    shard_tensor,
)
from mega_tp_layers.main_grad_fusion import (
    _out_dtype_addmm_works,
    addmm_into_main_grad,
    placeholder_grad,
)
from mega_zero_optim import DistributedDataParallel

S, B, H, FFN = 8, 2, 16, 32


def _check_addmm(m: int, n: int, k: int, dtype: torch.dtype, alpha: float, device: str) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    dy, x = torch.randn(m, n, generator=gen).to(dtype), torch.randn(m, k, generator=gen).to(dtype)
    main = torch.randn(n, k, generator=gen)
    got = main.clone().to(device)  # .to() of the same device is no copy
    addmm_into_main_grad(got, dy.to(device), x.to(device), alpha)
    exact = main.double() + alpha * dy.double().t() @ x.double()
    scale = main.abs().double() + abs(alpha) * dy.double().abs().t() @ x.double().abs()
    assert_close_to_reference(
        got.cpu(), exact.float(), reduction_length=m + 1, scale=float(scale.max()),
        name=f"{m}x{n}x{k} {dtype} alpha {alpha}",
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_addmm_into_main_grad(dtype: torch.dtype) -> None:
    _check_addmm(37, 24, 40, dtype, 0.5, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuBLAS with fp32 output)")
def test_addmm_into_main_grad_on_cuda() -> None:
    """The fused path itself: one cuBLAS GEMM reading and writing the fp32 buffer."""
    assert _out_dtype_addmm_works(torch.device("cuda")), "torch.addmm(out_dtype=fp32) fell back"
    _check_addmm(300, 192, 256, torch.bfloat16, 0.25, "cuda")


class _Block(nn.Module):
    def __init__(self, g: dist.ProcessGroup, sp: bool, fp8: Fp8Recipe | None = None) -> None:
        super().__init__()
        kw = {"tp_group": g, "sequence_parallel": sp, "init_method": Normal(0.3), "seed": 3}
        self.fc1 = ColumnParallelLinear(H, FFN, fp8=fp8, name="fc1", wgrad_fusion=True, **kw)  # type: ignore[arg-type]
        self.fc2 = RowParallelLinear(FFN, H, fp8=fp8, name="fc2", wgrad_fusion=True, **kw)  # type: ignore[arg-type]
        with torch.no_grad():
            self.fc1.bias.normal_(generator=torch.Generator().manual_seed(5))  # type: ignore[union-attr]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _data(dp: int) -> list[tuple[Tensor, Tensor]]:
    """Two micro-batches of every dp rank's ``[S, B, H]`` input and output gradient."""
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randn(dp, S, B, H, generator=gen), torch.randn(dp, S, B, H, generator=gen))
        for _ in range(2)
    ]


def _step(tp: int, sp: bool, mode: str, fused: bool) -> dict[str, Tensor]:
    groups = init_process_groups(ParallelConfig(tp=tp))
    block = _Block(groups.tp, sp)
    ddp = DistributedDataParallel(
        block, dp_group=groups.dp, use_distributed_optimizer=False, wgrad_into_main_grad=fused
    )  # all-reduced: every rank holds the whole gradient
    for layer in (block.fc1, block.fc2):
        assert hasattr(layer.weight, MAIN_GRAD_ALPHA_ATTR) == fused
        assert layer.bias is None or not hasattr(layer.bias, MAIN_GRAD_ALPHA_ATTR)
    forward = torch.compile(block, fullgraph=True) if mode == "compiled" else block
    dp_rank, tp_rank = dist.get_rank(groups.dp), dist.get_rank(groups.tp)
    ddp.zero_grad_buffer()
    for micro, (xs, dys) in enumerate(_data(ddp.dp_size)):
        x, dy = xs[dp_rank], dys[dp_rank]  # the wrapper averages over dp, as _reference
        if sp:
            x, dy = shard_tensor(x, 0, tp_rank, tp), shard_tensor(dy, 0, tp_rank, tp)
        sync = ddp.no_sync() if micro == 0 else contextlib.nullcontext()
        with sync:
            if mode == "split":
                with defer_weight_grads() as store:
                    forward(x.clone().requires_grad_()).backward(dy)
                store.run()
            else:
                forward(x.clone().requires_grad_()).backward(dy)
    ddp.finish_grad_sync()
    return {name: p.main_grad.clone() for name, p in block.named_parameters()}


def _fused_and_unfused(tp: int, sp: bool, mode: str) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    return _step(tp, sp, mode, True), _step(tp, sp, mode, False)


def _reference(dp: int) -> dict[str, Tensor]:
    """One process, every rank's tokens: the gradient of the dp ranks' mean loss, summed over
    the two micro-batches."""
    g = init_process_groups(ParallelConfig()).tp
    block = _Block(g, False)
    for xs, dys in _data(dp):
        for rank in range(dp):
            block(xs[rank].clone().requires_grad_()).backward(dys[rank] / dp)
    return {name: p.grad for name, p in block.named_parameters() if p.grad is not None}


N = H + FFN + 2 * S * B * 2  # the operands' chains, then two micro-batches of up to 2 ranks' tokens

LAYOUTS = [  # (tp, dp, sp, mode)
    (1, 1, False, "eager"),
    (1, 1, False, "compiled"),
    (1, 1, False, "split"),
    (1, 2, False, "eager"),
    (2, 1, False, "eager"),
    (2, 1, True, "eager"),
    (2, 1, True, "split"),
    (2, 1, False, "split"),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp{}-dp{}-sp{}-{}".format(*c) for c in LAYOUTS])
def test_fused_main_grad_equals_unfused(
    dist_pool: DistPool, layout: tuple[int, int, bool, str]
) -> None:
    tp, dp, sp, mode = layout
    results = dist_pool.run(_fused_and_unfused, tp * dp, (tp, sp, mode))
    for rank, (fused, plain) in enumerate(results):
        assert set(fused) == set(plain) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
        for name, grad in plain.items():
            assert float(grad.abs().max()) > 0, f"{name} got no gradient"
            assert_close_to_reference(
                fused[name], grad, reduction_length=N, name=f"rank {rank} {mode} {name}"
            )
    if tp == 1:
        reference = dist_pool.run(_reference, 1, (dp,))[0]
        for rank, (fused, _) in enumerate(results):
            for name, grad in reference.items():
                assert_close_to_reference(
                    fused[name], grad, reduction_length=N, name=f"rank {rank} {name} vs one process"
                )


def _cuda_main_grads(fused: bool, mode: str) -> dict[str, tuple[Tensor, Tensor]]:
    """bf16 column and row layers on the GPU under the wrapper, two micro-batches each of its
    own input and output gradient: every weight's ``main_grad`` beside the exact fp64
    ``sum_i dy_i^T x_i`` of the bf16 operands (inductor when compiled)."""
    groups = init_process_groups(ParallelConfig())
    h, ffn, tokens = 256, 384, 512  # tokens a micro-batch
    kw = {"tp_group": groups.tp, "bias": False, "init_method": Normal(0.3), "seed": 3,
          "wgrad_fusion": True}  # fmt: skip
    layers = nn.ModuleDict({
        "fc1": ColumnParallelLinear(h, ffn, name="fc1", **kw),  # type: ignore[arg-type]
        "fc2": RowParallelLinear(ffn, h, name="fc2", **kw),  # type: ignore[arg-type]
    }).to("cuda", torch.bfloat16)  # fmt: skip
    ddp = DistributedDataParallel(
        layers, dp_group=groups.dp, use_distributed_optimizer=False, wgrad_into_main_grad=fused
    )
    gen = torch.Generator().manual_seed(11)
    exact = {name: torch.zeros(layer.weight.shape, dtype=torch.float64)
             for name, layer in layers.items()}  # fmt: skip
    ddp.zero_grad_buffer()
    for micro in range(2):
        with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
            for name, layer in layers.items():
                n_in, n_out = layer.weight.shape[1], layer.weight.shape[0]
                x = torch.randn(tokens // 2, 2, n_in, generator=gen).bfloat16()
                dy = torch.randn(tokens // 2, 2, n_out, generator=gen).bfloat16()
                exact[name] += dy.double().flatten(0, 1).t() @ x.double().flatten(0, 1)
                forward = torch.compile(layer, fullgraph=True) if mode == "compiled" else layer
                forward(x.cuda().requires_grad_()).backward(dy.cuda())
    ddp.finish_grad_sync()
    return {name: (layer.weight.main_grad.float().cpu(), exact[name])
            for name, layer in layers.items()}  # fmt: skip


def _cuda_fused_and_unfused(mode: str) -> tuple[dict[str, tuple[Tensor, Tensor]], ...]:
    return _cuda_main_grads(True, mode), _cuda_main_grads(False, mode)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuBLAS with fp32 output)")
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_fused_main_grad_on_cuda(dist_pool: DistPool, mode: str) -> None:
    """The layers' fused path on the GPU: each micro-batch's bf16 products summed in fp32 into
    ``main_grad``, so the exact fp64 sum is met to fp32 rounding (n = the two micro-batches'
    tokens and the buffer). The unfused path rounds each micro-batch's gradient to bf16
    (relative 2^-9) first and misses that bound: the check tells the paths apart."""
    fused, unfused = dist_pool.run(_cuda_fused_and_unfused, 1, (mode,))[0]
    for name, (got, exact) in fused.items():
        assert float(exact.abs().max()) > 0
        assert_close_to_reference(got, exact.float(), reduction_length=2 * 512 + 1, name=name)
        plain, _ = unfused[name]
        with pytest.raises(AssertionError, match="exceeds the rounding bound"):
            assert_close_to_reference(plain, exact.float(), reduction_length=2 * 512 + 1, name=name)


class _Tied(nn.Module):
    def __init__(self, g: dist.ProcessGroup) -> None:
        super().__init__()
        self.a = ColumnParallelLinear(H, H, tp_group=g, bias=False, wgrad_fusion=True)
        self.b = ColumnParallelLinear(H, H, tp_group=g, bias=False, wgrad_fusion=True)
        self.b.weight = self.a.weight


def _offers() -> dict[str, bool]:
    """Where the wrapper offers the fusion: not to a tied weight, not to an fp8 layer (which
    does not mark its weight), not under ZeRO-2; and a later wrapper that cannot offer
    withdraws an earlier offer."""
    groups = init_process_groups(ParallelConfig())
    g, dp = groups.tp, groups.dp
    tied = _Tied(g)
    DistributedDataParallel(tied, dp_group=dp)
    fp8 = _Block(g, False, Fp8Recipe(emulate=True))
    DistributedDataParallel(fp8, dp_group=dp)
    plain = _Block(g, False)
    DistributedDataParallel(plain, dp_group=dp)
    first = hasattr(plain.fc1.weight, MAIN_GRAD_ALPHA_ATTR)
    DistributedDataParallel(plain, dp_group=dp, sharding="gradients")
    return {
        "tied": hasattr(tied.a.weight, MAIN_GRAD_ALPHA_ATTR),
        "fp8 marked": hasattr(fp8.fc1.weight, WGRAD_FUSION_ATTR),
        "plain": first,
        "after zero-2": hasattr(plain.fc1.weight, MAIN_GRAD_ALPHA_ATTR),
    }


def test_what_is_offered(dist_pool: DistPool) -> None:
    got = dist_pool.run(_offers, 1)[0]
    assert got == {"tied": False, "fp8 marked": False, "plain": True, "after zero-2": False}


def _functional_refusals() -> list[str]:
    g = init_process_groups(ParallelConfig()).tp
    x, w, key = torch.randn(4, 2, H), torch.randn(H, H), torch.zeros(1, dtype=torch.int64)
    messages = []
    try:
        column_parallel_linear(x, w, tp_group=g, fp8=Fp8Recipe(emulate=True), wgrad_key=key)
    except ValueError as e:
        messages.append(str(e))
    return messages


def test_functional_refuses_a_key_it_cannot_honour(dist_pool: DistPool) -> None:
    """An fp8 (or ring) column GEMM would drop an offered weight's gradient: one sentence."""
    assert dist_pool.run(_functional_refusals, 1)[0] == [
        "column_parallel_linear got a wgrad_key, but its fp8 GEMMs do not add the weight "
        "gradient into main_grad; pass wgrad_key=None there"
    ]


def _borrowed_key() -> str:
    """A layer that runs with another layer's key (both wrapped): its backward must not add
    into the other's main_grad."""
    groups = init_process_groups(ParallelConfig())
    layer = ColumnParallelLinear(H, H, tp_group=groups.tp, bias=False, wgrad_fusion=True)
    twin = ColumnParallelLinear(H, H, tp_group=groups.tp, bias=False, wgrad_fusion=True)
    twin._wgrad_key = layer._wgrad_key
    DistributedDataParallel(nn.ModuleList([layer, twin]), dp_group=groups.dp)
    try:
        twin(torch.randn(4, 2, H)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_borrowed_key_is_refused(dist_pool: DistPool) -> None:
    assert dist_pool.run(_borrowed_key, 1)[0] == (
        "the weight gradient of 'weight' was to go into the main_grad registered under its "
        "key, which belongs to another layer's weight; give each layer its own key "
        "(register_wgrad_target)"
    )


def test_the_placeholder_is_zeros_under_anomaly_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Anomaly detection checks every backward output for NaN: the stand-in gradient must not
    be uninitialised memory there (here uninitialised memory is made to hold NaNs); outside
    it, it is left unwritten (no fill a micro-batch)."""

    def uninitialised(t: Tensor) -> Tensor:
        return torch.full_like(t, float("nan"))

    monkeypatch.setattr(torch, "empty_like", uninitialised)
    weight = torch.ones(8, 16)
    with torch.autograd.set_detect_anomaly(True):
        assert torch.equal(placeholder_grad(weight), torch.zeros_like(weight))
    assert placeholder_grad(weight).isnan().all()
