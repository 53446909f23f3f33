"""``model.moe_expert_fp8``: the trainer runs the routed experts in FP8.

Checked: the settings it cannot serve are refused in one sentence; a step re-quantises the
expert weights the optimizer changed (the trainer invalidates every weight cache, the
experts' too); eager and compiled steps (no graph break) stay within the FP8 error of the
plain fp32 run. The bound of that last check: each expert GEMM sees its two operands
rounded to e4m3 (each to 2^-4 of itself), so an expert's output moves by ~2^-3 of its
size; the experts are one branch of a residual stream whose loss is a mean over tokens,
so the loss moves by less than 2^-4 of itself (measured here: ~1e-3 relative).
"""

from __future__ import annotations

import pytest
import torch

from mega_moe import Fp8ExpertWeights
from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_pretrain.build import build, gpt_config, parallel_config
from mega_pretrain.config import load_config
from mega_pretrain.estimate import estimate
from mega_pretrain.step import StepRunner
from mega_pretrain.validate import check_config, check_expert_fp8_device

SEQ, MICRO = 16, 2
_SMALL = [("model.size", "moe-tiny"), ("model.num_layers", "2"), ("model.moe_layer_pattern", "-E"),
          ("train.seq_len", str(SEQ)), ("train.micro_batch_size", str(MICRO)),
          ("train.global_batch_size", str(MICRO))]  # fmt: skip


def _config(fp8: bool, compiled: bool = False, *extra: tuple[str, str]):  # type: ignore[no-untyped-def]
    return load_config(None, [*_SMALL, ("model.moe_expert_fp8", str(fp8).lower()),
                              ("train.compile", str(compiled).lower()), *extra])  # fmt: skip


def _steps(fp8: bool, compiled: bool) -> tuple[list[float], bool, dict[str, int]]:
    """Three steps; whether the second step's expert weights were quantised afresh."""
    config = _config(fp8, compiled)
    model = gpt_config(config)
    groups = init_process_groups(parallel_config(config))
    dev = rank_device()
    built = build(config, groups, dev)
    runner = StepRunner(built, groups, seq_len=SEQ, micro_batch_size=MICRO,
                        hidden_size=model.hidden_size, dtype=torch.float32, device=dev,
                        sequence_parallel=False)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (MICRO, SEQ + 1), generator=gen)
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    caches = [m for c in built.chunks for m in c.modules() if isinstance(m, Fp8ExpertWeights)]
    assert len(caches) == (2 if fp8 else 0)  # one MoE layer: fc1 and fc2
    torch._dynamo.utils.counters.clear()
    losses, snapshots = [], []
    for _ in range(3):
        losses.append(float(runner.train_step(batch, 1e-2)[0]))
        snapshots.append([c.data.view(torch.uint8).clone() for c in caches])
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    torch._dynamo.reset()
    fresh = all(not torch.equal(a, b) for a, b in zip(snapshots[0], snapshots[1], strict=True))
    return losses, fresh, breaks


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_experts_train_within_their_error(dist_pool: DistPool, compiled: bool) -> None:
    [(plain, _, _)] = dist_pool.run(_steps, 1, args=(False, False))
    [(fp8, fresh, breaks)] = dist_pool.run(_steps, 1, args=(True, compiled), timeout=600)
    assert fresh, "the second step read the first step's fp8 weights"
    assert breaks == {}, breaks
    for step, (a, b) in enumerate(zip(fp8, plain, strict=True)):
        assert 0 < abs(a - b) <= 2.0**-4 * abs(b), (step, a, b)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [("parallel.sharding", "optim_grads_params"), ("parallel.distributed_optimizer", "true"),
             ("train.global_batch_size", "4")],
            "model.moe_expert_fp8 keeps every local expert's weight in fp8 for the whole step, "
            "which parallel.sharding optim_grads_params (ZeRO-3) exists to avoid; turn one of them off",
        ),
    ],
    ids=["zero3"],
)  # fmt: skip
def test_config_errors(overrides: list[tuple[str, str]], message: str) -> None:
    config = _config(True, False, *overrides)
    with pytest.raises(ValueError) as info:
        check_config(config, gpt_config(config), world_size=2)
    assert str(info.value) == message


def test_model_errors_are_one_sentence() -> None:
    with pytest.raises(ValueError, match=r"expert_fp8 runs the grouped experts' GEMMs in fp8, but "
                       r"experts is 'sequential'"):  # fmt: skip
        gpt_config(_config(True, False, ("model.moe_grouped_experts", "false")))
    with pytest.raises(ValueError, match=r"moe_expert_fp8 runs the routed experts in fp8, but "
                       r"num_experts is 0; set num_experts > 0"):  # fmt: skip
        gpt_config(load_config(None, [("model.moe_expert_fp8", "true")]))


@pytest.mark.parametrize(
    ("capability", "precision", "message"),
    [
        ((8, 0), "bf16", "model.moe_expert_fp8 runs torch._scaled_grouped_mm, which needs a GPU "
         "of compute capability 9.0 or newer (this one: 8.0); turn it off"),
        ((9, 0), "fp32", "model.moe_expert_fp8 on a GPU takes bf16 activations, but "
         "train.precision is fp32 (fp32); set --train.precision bf16 or turn it off"),
    ],
    ids=["ampere", "fp32"],
)  # fmt: skip
def test_device_errors(capability: tuple[int, int], precision: str, message: str) -> None:
    config = _config(True, False, ("train.precision", precision))
    with pytest.raises(ValueError) as info:
        check_expert_fp8_device(config, gpt_config(config), "cuda", capability)
    assert str(info.value) == message
    check_expert_fp8_device(config, gpt_config(config), "cpu")  # emulated: no device needs


def _expert_cache_bytes() -> tuple[int, int]:
    """(estimated cache bytes, the built expert caches' bytes)."""
    config = _config(True, False)
    plan = check_config(config, gpt_config(config), 1)
    built = build(config, init_process_groups(parallel_config(config)), rank_device())
    caches = [m for c in built.chunks for m in c.modules() if isinstance(m, Fp8ExpertWeights)]
    return estimate(plan).fp8_cache, sum(c.data.numel() + c.data_t.numel() for c in caches)


def test_estimate_counts_the_expert_cache(dist_pool: DistPool) -> None:
    """Two bytes a routed expert parameter (one e4m3 copy by rows, one by columns): exactly
    what the built caches hold (their fp32 scales, a 1/K share, are not counted)."""
    [(est, real)] = dist_pool.run(_expert_cache_bytes, 1)
    assert est == real > 0, (est, real)
