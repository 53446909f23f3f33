"""Expert weight gradients added straight into the wrapper's fp32 ``main_grad`` == through ``.grad``.

``grouped_wgrad_accumulate`` against the fp64 product (ATen's path here; the Triton kernel in
the interpreter, in a child process with ``TRITON_INTERPRET=1``, or compiled on CUDA), then
``GroupedMLP`` under mega-zero-optim's ``DistributedDataParallel`` (dp 1 and 2, fp32, two
micro-batches a step, host and device counts, an expert with no tokens): the ``main_grad``
the fused backward fills equals the one the wrapper fills from ``.grad``
(``wgrad_into_main_grad=False``) and the single-process gradient, eager, compiled and with
the weight gradients deferred to a W pass.

Tolerances. The accumulation: each element of ``dy_l^T x_l`` is a dot product over the
expert's rows (n <= 130), each product of values exact in the inputs' dtype, summed in fp32
(the kernel, ``_grouped_mm``) and added to ``main``: ``assert_close_to_reference``'s bound for
n = rows + 1 at the scale of ``sum |dy||x| + |main|``. The layer: the experts' chain of sums
(forward through H and FFN, back, then the tokens of a weight gradient): n = ``N`` below.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from mega_moe import GroupedMLP
from mega_moe.wgrad_accum import MAIN_GRAD_ALPHA_ATTR, grouped_wgrad_accumulate, main_grad_target
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, run_kernel_child
from mega_tp_layers import defer_weight_grads
from mega_zero_optim import DistributedDataParallel

H, FFN, E = 16, 32, 4
COUNTS = [3, 0, 5, 2]  # an expert with no tokens keeps its (zero) gradient
M = sum(COUNTS)
N = 2 * (H + FFN) + 2 * M  # the chain of sums, two micro-batches of tokens

# (counts, n, k, dtype, alpha): rows over one BLOCK_M step and several, masked tiles
KERNEL_CASES = [
    ([70, 0, 5, 130], 40, 24, torch.bfloat16, 1.0),
    ([1, 2, 3], 136, 130, torch.bfloat16, 0.5),
    ([17, 9], 8, 16, torch.float16, 2.0),
]


def _operands(
    counts: list[int], n: int, k: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(sum(counts) + n + k)
    rows = sum(counts)
    dy = torch.randn(rows, n, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    main = torch.randn(len(counts), n, k, generator=gen)
    ends = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    return main, dy, x, ends


def check_accumulate(
    counts: list[int], n: int, k: int, dtype: torch.dtype, alpha: float, device: str = "cpu",
    use_grouped_mm: bool = False, blocks: tuple[int, int, int, int, int, bool] | None = None,
) -> None:  # fmt: skip
    """``blocks``: run the Triton kernel itself at that configuration (else the dispatch)."""
    main, dy, x, ends = _operands(counts, n, k, dtype)
    start = main.clone()
    got = main.to(device)
    operands = (got, dy.to(device), x.to(device), ends.to(device), alpha)
    if blocks is None:
        grouped_wgrad_accumulate(*operands, use_grouped_mm=use_grouped_mm)
    else:
        from mega_moe._wgrad_triton import grouped_wgrad_accumulate_kernel

        grouped_wgrad_accumulate_kernel(*operands, blocks)
    exact = start.double()
    scale = start.double().abs()
    begin = 0
    for e, end in enumerate(torch.cumsum(torch.tensor(counts), 0).tolist()):
        d, xx = dy[begin:end].double(), x[begin:end].double()
        exact[e] += alpha * d.t() @ xx
        scale[e] += abs(alpha) * d.abs().t() @ xx.abs()
        begin = end
    assert_close_to_reference(
        got.cpu(), exact.float(), reduction_length=max(counts) + 1, scale=float(scale.max()),
        name=f"{counts} {n}x{k} {dtype} alpha {alpha}",
    )  # fmt: skip
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(got[e].cpu(), start[e]), "an expert with no rows was written"


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[str(c[0]) for c in KERNEL_CASES])
@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped_mm"])
def test_aten_path(case: tuple[list[int], int, int, torch.dtype, float], grouped: bool) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter is on: the kernel runs here (the next test covers it)")
    if grouped and not (hasattr(torch, "_grouped_mm") and torch.__version__ >= "2.9"):
        pytest.skip("torch._grouped_mm has no CPU kernel in this torch")
    counts, n, k, dtype, alpha = case
    if grouped:  # its CPU kernel: fp32/bf16, 16-byte aligned rows
        dtype, n, k = torch.float32, 8 * (n // 8 + 1), 8 * (k // 8 + 1)
    check_accumulate(counts, n, k, dtype, alpha, use_grouped_mm=grouped)


def test_triton_kernel() -> None:
    """The kernel in a child process: interpreted on CPU, compiled on CUDA; through the
    dispatch (the default blocks) and at each configuration that reads the main gradient
    before the products (``PREFETCH``)."""
    pytest.importorskip("triton")
    cuda = torch.cuda.is_available()
    code = (
        "import json, torch, runpy\n"
        f"mod = runpy.run_path({__file__!r})\n"
        f"dev = 'cuda' if {cuda} else 'cpu'\n"
        "from mega_moe.wgrad_accum import _kernel_applies\n"
        "probe = torch.zeros(1, 2, 2, device=dev)\n"
        "assert _kernel_applies(probe, probe[0].bfloat16(), probe[0].bfloat16())\n"
        "from mega_moe._wgrad_triton import TUNING\n"
        "configs = [None] + [b for b in TUNING if b[5]]\n"
        "out = {}\n"
        "for i, case in enumerate(mod['KERNEL_CASES']):\n"
        "    for blocks in configs:\n"
        "        try:\n"
        "            mod['check_accumulate'](*case, dev, blocks=blocks)\n"
        "            out[f'{i} {blocks}'] = 'ok'\n"
        "        except AssertionError as e:\n"
        "            out[f'{i} {blocks}'] = str(e)\n"
        "print(json.dumps(out))\n"
    )
    stdout = run_kernel_child(code)
    results = json.loads(stdout.strip().splitlines()[-1])
    from mega_moe._wgrad_triton import TUNING

    prefetching = sum(1 for b in TUNING if b[5])
    assert prefetching > 0
    assert len(results) == len(KERNEL_CASES) * (1 + prefetching), results
    assert all(v == "ok" for v in results.values()), results


def test_bad_shapes_are_one_sentence() -> None:
    main, dy, x, ends = _operands([2, 3], 4, 6, torch.float32)
    with pytest.raises(ValueError, match=r"main \(2, 4, 6\) must be \[L, N, K\] for dy \(5, 6\)"):
        grouped_wgrad_accumulate(main, x, x, ends)
    with pytest.raises(ValueError, match=r"main must be float32 \(got torch.bfloat16\)"):
        grouped_wgrad_accumulate(main.bfloat16(), dy, x, ends)


# the layer under the data-parallel wrapper ------------------------------------------------


def _step(fused: bool, device_counts: bool, mode: str) -> dict[str, Tensor]:
    """Two micro-batches through ``GroupedMLP`` under the wrapper: the main grads, summed
    over dp (each rank's tokens are its half of one global batch)."""
    groups = init_process_groups(ParallelConfig())
    mlp = GroupedMLP(H, FFN, E, seed=0)
    ddp = DistributedDataParallel(
        mlp, dp_group=groups.dp, use_distributed_optimizer=False, wgrad_into_main_grad=fused
    )  # all-reduced: every rank holds the whole gradient
    assert hasattr(mlp.weight1, MAIN_GRAD_ALPHA_ATTR) == fused
    forward = torch.compile(mlp, fullgraph=True) if mode == "compiled" else mlp
    ddp.zero_grad_buffer()
    dp, rank = ddp.dp_size, dist.get_rank()
    gen = torch.Generator().manual_seed(5)
    for micro in range(2):
        x = torch.randn(dp, M, H, generator=gen)[rank].clone()
        dy = torch.randn(dp, M, H, generator=gen)[rank].clone()
        counts: list[int] | Tensor = torch.tensor(COUNTS) if device_counts else COUNTS
        with ddp.no_sync() if micro == 0 else _nothing():
            if mode == "split":
                with defer_weight_grads() as store:
                    out = forward(x.requires_grad_(), counts)
                    out.backward(dy)
                store.run()
            else:
                forward(x.requires_grad_(), counts).backward(dy)
    ddp.finish_grad_sync()
    return {name: p.main_grad.clone() for name, p in mlp.named_parameters()}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _reference(dp: int, device_counts: bool) -> dict[str, Tensor]:
    """One process, every rank's tokens: the gradient of the dp ranks' mean loss, summed
    over the two micro-batches (what ``grad_reduce="mean"`` gives)."""
    mlp = GroupedMLP(H, FFN, E, seed=0)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        xs, dys = torch.randn(dp, M, H, generator=gen), torch.randn(dp, M, H, generator=gen)
        for rank in range(dp):
            counts: list[int] | Tensor = torch.tensor(COUNTS) if device_counts else COUNTS
            mlp(xs[rank].clone().requires_grad_(), counts).backward(dys[rank] / dp)
    return {name: p.grad for name, p in mlp.named_parameters() if p.grad is not None}


def _run_layout(dp: int, device_counts: bool, mode: str) -> dict[str, Tensor]:
    fused = _step(True, device_counts, mode)
    plain = _step(False, device_counts, mode)
    for name, grad in plain.items():
        assert_close_to_reference(fused[name], grad, reduction_length=N, name=f"{mode} {name}")
    assert torch.count_nonzero(fused["weight1"][1]) == 0  # expert 1 had no tokens
    return fused


@pytest.mark.parametrize("mode", ["eager", "compiled", "split"])
@pytest.mark.parametrize("device_counts", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("dp", [1, 2])
def test_fused_main_grad_equals_unfused(
    dist_pool: DistPool, dp: int, device_counts: bool, mode: str
) -> None:
    results = dist_pool.run(_run_layout, dp, (dp, device_counts, mode))
    reference = _reference(dp, device_counts)
    assert set(reference) == set(results[0])
    for name, grad in reference.items():
        for rank, got in enumerate(results):  # every rank holds the reduced gradient
            assert_close_to_reference(got[name], grad, reduction_length=N, name=f"{rank} {name}")


def _cuda_grads(fused: bool, mode: str) -> dict[str, Tensor]:
    """bf16 experts on the GPU at a size that runs the kernel's full tiles: main grads after
    two micro-batches (inductor when compiled)."""
    groups = init_process_groups(ParallelConfig())
    h, ffn, experts = 256, 192, 8
    mlp = GroupedMLP(h, ffn, experts, seed=0, dtype=torch.bfloat16, device="cuda")
    ddp = DistributedDataParallel(mlp, dp_group=groups.dp, wgrad_into_main_grad=fused)
    forward = torch.compile(mlp, fullgraph=True) if mode == "compiled" else mlp
    ddp.zero_grad_buffer()
    gen = torch.Generator().manual_seed(3)
    counts = torch.tensor([300, 0, 17, 129, 64, 1, 200, 90])
    for micro in range(2):
        x = torch.randn(int(counts.sum()), h, generator=gen).to("cuda", torch.bfloat16)
        dy = torch.randn(int(counts.sum()), h, generator=gen).to("cuda", torch.bfloat16)
        with ddp.no_sync() if micro == 0 else _nothing():
            forward(x.requires_grad_(), counts.cuda()).backward(dy)
    ddp.finish_grad_sync()
    return {name: p.main_grad.float().cpu() for name, p in mlp.named_parameters()}


def _cuda_fused_and_unfused(mode: str) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    return _cuda_grads(True, mode), _cuda_grads(False, mode)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bf16 experts, the kernel)")
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_fused_main_grad_on_cuda(dist_pool: DistPool, mode: str) -> None:
    """The unfused path rounds each micro-batch's weight gradient to bf16 (relative 2^-9 of
    the element) before adding it in fp32; the fused one does not. Two micro-batches: the
    two differ by at most 2 * 2^-9 of the sum of the two products' magnitudes, bounded here
    by 4 * 2^-9 of the largest element (the products are of like size)."""
    fused, unfused = dist_pool.run(_cuda_fused_and_unfused, 1, (mode,))[0]
    for name, want in unfused.items():
        err = float((fused[name] - want).abs().max())
        bound = 4 * 2.0**-9 * float(want.abs().max())
        assert 0 < float(want.abs().max()) and err <= bound, (name, err, bound)


def _offers(sharding: str, fused: bool) -> tuple[bool, bool]:
    """Whether the wrapper offers the fusion (ZeRO-1 with fp32 gradients only), and whether a
    ZeRO-1 offer is withdrawn by a later wrapper that cannot make one."""
    groups = init_process_groups(ParallelConfig())
    mlp = GroupedMLP(H, FFN, E, seed=0)
    DistributedDataParallel(mlp, dp_group=groups.dp, wgrad_into_main_grad=True)
    first = hasattr(mlp.weight1, MAIN_GRAD_ALPHA_ATTR)
    DistributedDataParallel(
        mlp, dp_group=groups.dp, sharding=sharding, wgrad_into_main_grad=fused
    )  # fmt: skip
    return first, hasattr(mlp.weight1, MAIN_GRAD_ALPHA_ATTR)


@pytest.mark.parametrize(
    ("sharding", "fused", "offered"),
    [("optimizer", True, True), ("optimizer", False, False), ("gradients", True, False)],
)
def test_offer_follows_the_wrapper(
    dist_pool: DistPool, sharding: str, fused: bool, offered: bool
) -> None:
    first, second = dist_pool.run(_offers, 1, (sharding, fused))[0]
    assert first and second == offered


def test_a_vanished_offer_is_one_sentence() -> None:
    """Backward after the wrapper's offer was withdrawn: one sentence, not a wrong sum."""
    mlp = GroupedMLP(H, FFN, E, seed=0)
    key = mlp._wgrad_keys[0]
    with pytest.raises(RuntimeError, match="'weight1' was to go into its main_grad, but its"):
        main_grad_target(key)
    mlp.weight1.main_grad = torch.zeros_like(mlp.weight1)  # type: ignore[attr-defined]
    setattr(mlp.weight1, MAIN_GRAD_ALPHA_ATTR, 0.5)
    main, alpha = main_grad_target(key)
    assert main is mlp.weight1.main_grad and alpha == 0.5  # type: ignore[attr-defined]


def _two_layers_one_graph() -> list[dict[str, Tensor]]:
    """Two GroupedMLPs (different keys) under one wrapper, each compiled: the second must
    reuse the first's graph (a recompile raises), and each main_grad must be its own."""
    groups = init_process_groups(ParallelConfig())
    layers = torch.nn.ModuleList([GroupedMLP(H, FFN, E, seed=s) for s in (0, 1)])
    ddp = DistributedDataParallel(layers, dp_group=groups.dp, use_distributed_optimizer=False)
    assert all(hasattr(m.weight1, MAIN_GRAD_ALPHA_ATTR) for m in layers)
    torch._dynamo.reset()
    ddp.zero_grad_buffer()
    gen = torch.Generator().manual_seed(7)
    x, dy = torch.randn(M, H, generator=gen), torch.randn(M, H, generator=gen)
    for i, layer in enumerate(layers):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            torch.compile(layer, fullgraph=True)(x.clone().requires_grad_(), COUNTS).backward(dy)
    ddp.finish_grad_sync()
    return [{n: p.main_grad.clone() for n, p in m.named_parameters()} for m in layers]


def test_layers_share_one_compiled_graph(dist_pool: DistPool) -> None:
    """The key is a host tensor, not an int: an int was a constant each layer compiled for,
    and past dynamo's recompile limit (8) the further layers of deepseek-3b ran eagerly."""
    got = dist_pool.run(_two_layers_one_graph, 1)[0]
    gen = torch.Generator().manual_seed(7)
    x, dy = torch.randn(M, H, generator=gen), torch.randn(M, H, generator=gen)
    for seed, grads in zip((0, 1), got, strict=True):
        mlp = GroupedMLP(H, FFN, E, seed=seed)
        mlp(x.clone().requires_grad_(), COUNTS).backward(dy)
        for name, p in mlp.named_parameters():
            assert p.grad is not None
            assert_close_to_reference(grads[name], p.grad, reduction_length=N, name=name)
