"""``Fp8Recipe(cache_weights=True)``: a layer's fp8 weight kept across one step's micro-batches.

What is checked, and why each check is exact: the cache holds the values quantising the
weight would give (the same function of the same tensor), so a cached layer computes what an
uncached one computes, bit for bit: outputs, input and weight gradients, and weights after
optimizer steps, at tp 1 and tp 2 (with and without sequence parallelism), with current and
delayed scaling, eager and compiled. What the cache changes is how often the weight is
quantised: counted at the dispatcher (``abs`` of a weight-shaped tensor is the amax pass),
once per step and layer instead of once per micro-batch. That the cache is really read is
shown the other way round: a weight changed without invalidating leaves the cached layer
computing with the old fp8 weight.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_tp_layers import (
    ColumnParallelLinear,
    Fp8Recipe,
    Fp8WeightCache,
    Normal,
    RowParallelLinear,
    column_parallel_linear,
    fp8_linear,
    fp8_weight_caches,
    invalidate_fp8_weight_caches,
    shard_tensor,
    update_fp8_amax_histories,
)
from mega_tp_layers.fp8 import Fp8Tensor, fp8_quantize
from mega_tp_layers.fp8_scaling import check_fp8_layout

SEED = 7
S, B, H, FFN = 8, 2, 32, 64  # tokens S*B = 16 differ from every weight dim: see _AmaxPasses
STEPS, MICRO = 2, 3
RECIPES = {
    "current": Fp8Recipe(emulate=True),
    "delayed": Fp8Recipe(emulate=True, amax_history=2),
}


def _cached(recipe: Fp8Recipe) -> Fp8Recipe:
    return Fp8Recipe(emulate=True, amax_history=recipe.amax_history, cache_weights=True)


def _randn(*shape: int, seed: int, scale: float = 1.0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


class _AmaxPasses(TorchDispatchMode):
    """Counts ``abs`` over tensors shaped like a weight: the weight's amax pass (activations
    and gradients have 16 rows, which no weight has)."""

    def __init__(self, shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.shapes, self.count = shapes, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.abs.default and tuple(args[0].shape) in self.shapes:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _block(recipe: Fp8Recipe, tp_group: Any, sp: bool) -> nn.ModuleList:
    common: dict[str, Any] = {"tp_group": tp_group, "sequence_parallel": sp, "bias": False,
                              "init_method": Normal(0.3), "seed": SEED, "device": rank_device(),
                              "fp8": recipe}  # fmt: skip
    fc1 = ColumnParallelLinear(H, FFN, name="fc1", **common)
    fc2 = RowParallelLinear(FFN, H, name="fc2", **common)
    return nn.ModuleList([fc1, fc2])


def _train(block: nn.ModuleList, tp: int, sp: bool, invalidate: bool = True) -> dict[str, Any]:
    """STEPS SGD steps of MICRO micro-batches: outputs, input gradients, weight gradients,
    weights after each step, and the number of weight amax passes."""
    rank = torch.distributed.get_rank()
    fc1, fc2 = block
    shapes = {tuple(fc1.weight.shape), tuple(fc2.weight.shape)}
    outs, grads, weights, passes = [], [], [], 0
    for step in range(STEPS):
        if invalidate:
            invalidate_fp8_weight_caches(block)
        for m in range(MICRO):
            seed = 100 + 10 * step + m
            x, dy = _randn(S, B, H, seed=seed, scale=1.0 + step), _randn(S, B, H, seed=seed + 5)
            if sp:
                x, dy = shard_tensor(x, 0, rank, tp), shard_tensor(dy, 0, rank, tp)
            x = x.to(rank_device()).requires_grad_(True)
            with _AmaxPasses(shapes) as counter:
                y = fc2(F.gelu(fc1(x)))
                y.backward(dy.to(rank_device()))
            passes += counter.count
            assert x.grad is not None
            outs.append(y.detach().cpu())
            grads.append(x.grad.cpu())
        update_fp8_amax_histories(block, torch.distributed.group.WORLD)
        with torch.no_grad():
            for p in block.parameters():
                assert p.grad is not None
                grads.append(p.grad.cpu().clone())
                p -= 0.5 * p.grad
                p.grad = None
        weights.append([p.detach().cpu().clone() for p in block.parameters()])
    return {"outs": outs, "grads": grads, "weights": weights, "passes": passes}


def _equal(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    for key in ("outs", "grads"):
        for i, (g, w) in enumerate(zip(got[key], want[key], strict=True)):
            assert torch.equal(g, w), f"{what}: {key}[{i}] differs by {float((g - w).abs().max())}"
    for g_step, w_step in zip(got["weights"], want["weights"], strict=True):
        assert all(torch.equal(g, w) for g, w in zip(g_step, w_step, strict=True)), what


def _cached_equals_uncached(tp: int, sp: bool, recipe_name: str) -> None:
    groups = init_process_groups(ParallelConfig(tp=tp))
    recipe = RECIPES[recipe_name]
    plain = _train(_block(recipe, groups.tp, sp), tp, sp)
    cached_block = _block(_cached(recipe), groups.tp, sp)
    assert len(fp8_weight_caches(cached_block)) == 2
    cached = _train(cached_block, tp, sp)
    _equal(cached, plain, f"tp{tp}{' sp' if sp else ''} {recipe_name}")
    # the weight's amax pass: once per micro-batch and layer, or once per step and layer
    assert plain["passes"] == 2 * STEPS * MICRO, plain["passes"]
    assert cached["passes"] == 2 * STEPS, cached["passes"]


LAYOUTS = [(1, False), (2, False), (2, True)]


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize(
    ("tp", "sp"), LAYOUTS, ids=[f"tp{t}{'-sp' if s else ''}" for t, s in LAYOUTS]
)
def test_cached_layers_compute_what_uncached_ones_do(
    dist_pool: DistPool, tp: int, sp: bool, recipe_name: str
) -> None:
    dist_pool.run(_cached_equals_uncached, tp, args=(tp, sp, recipe_name))


def _stale_without_invalidation() -> None:
    groups = init_process_groups(ParallelConfig(tp=1))
    recipe = RECIPES["current"]
    plain = _train(_block(recipe, groups.tp, False), 1, False)
    cached = _train(_block(_cached(recipe), groups.tp, False), 1, False, invalidate=False)
    per_step = MICRO
    # the first step is filled and read as it should be; the second reads step 1's weights
    first = zip(cached["outs"][:per_step], plain["outs"][:per_step], strict=True)
    assert all(torch.equal(g, w) for g, w in first)
    assert not any(
        torch.equal(g, w)
        for g, w in zip(cached["outs"][per_step:], plain["outs"][per_step:], strict=True)
    )


def test_a_weight_changed_without_invalidating_is_read_stale(dist_pool: DistPool) -> None:
    dist_pool.run(_stale_without_invalidation, 1)


class _Linear(nn.Module):
    """``fp8_linear`` with a weight cache, as the layers wire it."""

    def __init__(self, recipe: Fp8Recipe, weight: Tensor) -> None:
        super().__init__()
        self.recipe, self.weight = recipe, nn.Parameter(weight.clone())
        self.fp8_weight = Fp8WeightCache((weight.shape[0], weight.shape[1]), recipe.fwd_dtype)

    def forward(self, x: Tensor) -> Tensor:
        wq = self.fp8_weight.quantized(self.weight, self.recipe, None)
        return fp8_linear(x, self.weight, recipe=self.recipe, weight_q=wq)


def _steps(layer: nn.Module, invalidate: Callable[[], None]) -> list[Tensor]:
    results = []
    for step in range(STEPS):
        invalidate()
        for m in range(2):
            x = _randn(16, H, seed=20 + 2 * step + m, scale=1.0 + step).requires_grad_(True)
            y = layer(x)
            y.backward(_randn(16, FFN, seed=40 + 2 * step + m))
            assert x.grad is not None
            results += [y.detach(), x.grad]
        with torch.no_grad():
            for p in layer.parameters():
                assert p.grad is not None
                results.append(p.grad.clone())
                p -= 0.5 * p.grad
                p.grad = None
    return results


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager(backend: str) -> None:
    """The valid flag gives two variants (filling, reading); the buffer writes survive
    compilation (Inductor on CPU here)."""
    recipe = _cached(RECIPES["current"])
    w = _randn(FFN, H, seed=15)
    eager, compiled_layer = _Linear(recipe, w), _Linear(recipe, w)
    compiled = torch.compile(compiled_layer, backend=backend, fullgraph=True)
    try:
        want = _steps(eager, lambda: invalidate_fp8_weight_caches([eager]))
        got = _steps(compiled, lambda: invalidate_fp8_weight_caches([compiled_layer]))
        for i, (g, e) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, e, rtol=2**-20, atol=0, msg=f"result {i}")
        assert compiled_layer.fp8_weight.valid
        assert torch.equal(compiled_layer.fp8_weight.data, eager.fp8_weight.data)
    finally:
        torch._dynamo.reset()


def test_recomputation_reads_the_same_weight() -> None:
    """Activation checkpointing runs the forward again in the backward: from the cache."""
    recipe = _cached(RECIPES["current"])
    w = _randn(FFN, H, seed=16)
    plain, layer = _Linear(recipe, w), _Linear(recipe, w)

    def checkpointed(x: Tensor) -> Tensor:
        out: Tensor = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        return out

    class _Wrapped(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return checkpointed(x)

    wrapped = _Wrapped()
    wrapped.inner = layer  # its parameters, for the optimizer step of _steps
    want = _steps(plain, lambda: invalidate_fp8_weight_caches([plain]))
    got = _steps(wrapped, lambda: invalidate_fp8_weight_caches([layer]))
    assert all(torch.equal(g, e) for g, e in zip(got, want, strict=True))


def test_cache_stays_fp8_off_the_state_dict_and_refills_after_a_move() -> None:
    recipe = _cached(RECIPES["current"])
    layer = _Linear(recipe, _randn(FFN, H, seed=17))
    layer(_randn(16, H, seed=18))
    assert layer.fp8_weight.valid
    assert not any("fp8_weight" in key for key in layer.state_dict())
    layer.to(torch.bfloat16)
    cache = layer.fp8_weight
    assert cache.data.dtype == torch.float8_e4m3fn and cache.inv_scale.dtype == torch.float32
    assert not cache.valid  # cast: filled again from the (now bf16) weight
    want = fp8_quantize(layer.weight, torch.float8_e4m3fn)
    layer(_randn(16, H, seed=18).bfloat16())
    assert torch.equal(cache.data.float(), want.data.float())
    assert torch.equal(cache.inv_scale, want.inv_scale)
    twin = copy.deepcopy(layer)
    assert twin.fp8_weight.valid and twin.fp8_weight.data is not cache.data
    with torch.device("meta"):
        meta = _Linear(recipe, torch.empty(FFN, H))
    meta.to_empty(device="cpu")
    assert meta.fp8_weight.data.dtype == torch.float8_e4m3fn and not meta.fp8_weight.valid


def test_the_dgrad_takes_the_cached_column_major_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache keeps the weight transposed too, so the dgrad GEMM's column-major operand
    is not copied each micro-batch: ``torch._scaled_mm`` (faked here, as on a GPU) receives
    the cache's own buffer, and it holds the forward's values."""
    import mega_tp_layers.fp8_gemm as fp8_gemm

    seen: list[Tensor] = []

    def fake_scaled_mm(a: Tensor, b: Tensor, **kwargs: Any) -> Tensor:
        seen.append(b)
        out = (a.float() @ b.float()) * (kwargs["scale_a"] * kwargs["scale_b"])
        return out.to(kwargs["out_dtype"])

    monkeypatch.setattr(fp8_gemm, "fp8_gemm_supported", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    recipe = Fp8Recipe(emulate=False, cache_weights=True)
    layer = _Linear(recipe, _randn(FFN, H, seed=19))
    for m in range(2):
        x = _randn(16, H, seed=30 + m).requires_grad_(True)
        layer(x).backward(_randn(16, FFN, seed=40 + m))
    cache = layer.fp8_weight
    dgrads = [b for b in seen if tuple(b.shape) == (FFN, H)]  # b of dy [16, FFN] @ W [FFN, H]
    assert len(dgrads) == 2
    for b in dgrads:
        assert b.data_ptr() == cache.data_t.data_ptr() and b.t().is_contiguous()
        assert torch.equal(b.float(), cache.data.float())


# ---- bad input: one sentence naming the values and the way out ----------------------------

CACHED = _cached(RECIPES["current"])
W8 = Fp8Tensor(torch.zeros(16, 32, dtype=torch.float8_e4m3fn), torch.ones(()))


@pytest.mark.parametrize(
    ("build", "pattern"),
    [
        (lambda: Fp8Recipe(cache_weights=1), r"^Fp8Recipe.cache_weights \(1\) must be True or "),
        (
            lambda: Fp8Recipe(scaling="row", cache_weights=True),
            r"cache_weights=True\) keeps a tensor-wise fp8 weight, not scaling='row'",
        ),
        (
            lambda: check_fp8_layout("ColumnParallelLinear", CACHED, 2, ("out/tp", 32), True),
            r"tp_comm_overlap=True quantises the weight in its rings, not from "
            r"Fp8Recipe\(cache_weights=True\)'s cache; turn the overlap off",
        ),
        (
            lambda: fp8_linear(torch.ones(16, 16), torch.ones(16, 16), recipe=CACHED, weight_q=W8),
            r"fp8_linear got a quantised weight of shape \(16, 32\) and dtype "
            r"torch.float8_e4m3fn for a weight of shape \(16, 16\)",
        ),
        (
            lambda: fp8_linear(
                torch.ones(16, 32), torch.ones(16, 32), recipe=Fp8Recipe(scaling="row"), weight_q=W8
            ),
            r"fp8_linear got a quantised weight, which is tensor-wise, but the recipe scales "
            r"row-wise",
        ),
        (
            lambda: column_parallel_linear(
                torch.ones(2, 16, 32),
                torch.ones(16, 32),
                tp_group=None,  # type: ignore[arg-type]
                fp8_weight=W8,
            ),
            r"column_parallel_linear got an fp8_weight but no fp8 recipe; pass fp8=Fp8Recipe\(\)",
        ),
        (
            lambda: Fp8WeightCache((16, 16), torch.float8_e4m3fn).quantized(
                torch.ones(16, 32), CACHED, None
            ),
            r"Fp8WeightCache holds a weight of shape \(16, 16\), got \(16, 32\)",
        ),
        (
            lambda: Fp8WeightCache((16, 16), torch.bfloat16),
            r"^Fp8WeightCache dtype \(torch.bfloat16\) is not an fp8 format; use the recipe's",
        ),
    ],
    ids=[
        "not-bool",
        "row",
        "overlap",
        "shape",
        "row-recipe",
        "no-recipe",
        "cache-shape",
        "cache-dtype",
    ],
)
def test_bad_input_raises_one_sentence(build: Any, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern) as info:
        build()
    assert ". " not in str(info.value).rstrip(".")
