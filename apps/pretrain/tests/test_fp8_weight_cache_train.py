"""``train.fp8_weight_cache``: each layer's fp8 weight quantised once a step, in the trainer.

The tiny GPT cut to 2 layers, bf16 parameters and emulated fp8 on CPU, 3 AdamW steps of a
global batch of 3 micro-batches, then an evaluation. Exact, and why: the cache holds what
quantising the weight gives, so a run with it computes what a run without it computes, bit
for bit, as long as the trainer invalidates it whenever the weights change (each step and
each evaluation starts invalidated). A trainer that forgot would run step 2 on step 1's fp8
weights, and the losses would part. Checked at one process, at tp 2 with sequence
parallelism (the column layers' other path) and at pp 2 under 1F1B and ZB-H1 (the step's
micro-batches interleaved across stages, weight gradients deferred) and with full activation
recomputation (the backward's forwards read the cache), with current and delayed scaling.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_pretrain.build import build, gpt_config, parallel_config, param_dtype
from mega_pretrain.config import TrainerConfig, load_config
from mega_pretrain.step import StepRunner
from mega_pretrain.validate import check_config
from mega_tp_layers import Fp8WeightCache

SEQ, MICRO, GLOBAL, STEPS, LR, LAYERS = 32, 2, 6, 3, 3e-3, 2


def _config(cache: bool, history: int, layout: dict[str, object]) -> TrainerConfig:
    pairs: dict[str, object] = {
        "model.num_layers": LAYERS, "train.seq_len": SEQ, "train.micro_batch_size": MICRO,
        "train.global_batch_size": GLOBAL, "train.precision": "bf16", "train.fp8": True,
        "train.fp8_amax_history": history, "train.fp8_weight_cache": cache,
        "parallel.bucket_size": 1000,
    }  # fmt: skip
    pairs.update({k if "." in k else f"parallel.{k}": v for k, v in layout.items()})
    return load_config(None, [(k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in pairs.items()])  # fmt: skip


def _batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, 257, (GLOBAL, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return [
        (tokens[i : i + MICRO, :-1], tokens[i : i + MICRO, 1:]) for i in range(0, GLOBAL, MICRO)
    ]


def _run(cache: bool, history: int, layout: dict[str, object]) -> tuple[list[float], list[bytes]]:
    """Losses of STEPS steps and an evaluation, and the weights after them (as bytes)."""
    config = _config(cache, history, layout)
    check_config(config, gpt_config(config), world_size=torch.distributed.get_world_size())
    groups = init_process_groups(parallel_config(config))
    built = build(config, groups, rank_device())
    runner = StepRunner(
        built, groups, seq_len=SEQ, micro_batch_size=MICRO,
        hidden_size=gpt_config(config).hidden_size, dtype=param_dtype(config),
        device=rank_device(), sequence_parallel=config.parallel.sequence_parallel,
    )  # fmt: skip
    caches = [m for chunk in built.chunks for m in chunk.modules() if isinstance(m, Fp8WeightCache)]
    assert len(caches) == (4 * LAYERS // groups.size("pp") if cache else 0)  # the rank's layers
    losses = []
    for step in range(STEPS):
        losses.append(float(runner.train_step(_batches(step), LR)[0]))
        assert all(c.valid for c in caches)  # filled by the step's first micro-batch
    losses.append(float(runner.eval_step(_batches(STEPS))))
    weights = [
        p.detach().float().cpu().numpy().tobytes()
        for chunk in built.chunks
        for p in chunk.parameters()
    ]
    return losses, weights


LAYOUTS = {
    "one-process": ({}, 1),
    "tp2-sp": ({"tp": 2, "sequence_parallel": True}, 2),
    # pipelines run many micro-batches a step, interleaved: the cache's main use
    "pp2-1f1b": ({"pp": 2}, 2),
    "pp2-zb-h1": ({"pp": 2, "pp_schedule": "zb-h1"}, 2),  # weight gradients deferred
    "recompute-full": ({"train.recompute": "full"}, 1),  # forwards run again in backward
}


@pytest.mark.parametrize("history", [0, 2], ids=["current", "delayed"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cached_run_is_the_uncached_run(dist_pool: DistPool, layout: str, history: int) -> None:
    parallel, ranks = LAYOUTS[layout]
    plain = dist_pool.run(_run, ranks, args=(False, history, parallel))
    cached = dist_pool.run(_run, ranks, args=(True, history, parallel))
    for rank, ((want_losses, want_weights), (losses, weights)) in enumerate(
        zip(plain, cached, strict=True)
    ):
        assert losses == want_losses, (rank, losses, want_losses)
        assert weights == want_weights, f"rank {rank}: weights differ after {STEPS} steps"


FP8 = [("train.fp8", "true"), ("train.precision", "bf16"), ("train.fp8_weight_cache", "true")]


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (
            [("train.fp8_weight_cache", "true")],
            r"^train.fp8_weight_cache keeps tensor-wise fp8 weights, which needs train.fp8 true "
            r"and train.fp8_recipe tensor \(got fp8=false, recipe tensor\); set those",
        ),
        (
            [*FP8, ("train.fp8_recipe", "block")],
            r"\(got fp8=true, recipe block\); set those or train.fp8_weight_cache false$",
        ),
        (
            [*FP8, ("parallel.tp", "2"), ("parallel.sequence_parallel", "true"),
             ("parallel.tp_comm_overlap", "true")],
            r"^train.fp8_weight_cache is not supported with parallel.tp_comm_overlap true",
        ),
        (
            [*FP8, ("parallel.distributed_optimizer", "true"), ("parallel.sharding", "parameters")],
            r"^train.fp8_weight_cache holds every layer's whole weight in fp8 for the run, "
            r"which parallel.sharding parameters \(ZeRO-3\) exists to avoid",
        ),
        (
            [*FP8, ("train.compile", "true"), ("train.compile_mode", "reduce-overhead")],
            r"train.compile_mode reduce-overhead \(CUDA graphs\) has not been run with",
        ),
    ],
    ids=["without-fp8", "block-recipe", "tp-comm-overlap", "zero3", "cuda-graphs"],
)  # fmt: skip
def test_weight_cache_config_errors(overrides: list[tuple[str, str]], pattern: str) -> None:
    config = load_config(None, overrides)
    with pytest.raises(ValueError, match=pattern) as info:
        check_config(config, gpt_config(config), world_size=2)
    assert ". " not in str(info.value)  # one sentence


def test_weight_cache_needs_a_bool() -> None:
    """A config built in Python (the file and command-line parser refuse it first)."""
    config = load_config(None, FP8)
    config = dataclasses.replace(
        config, train=dataclasses.replace(config.train, fp8_weight_cache=1)
    )
    with pytest.raises(ValueError, match=r"^train.fp8_weight_cache \(1\) must be true or false$"):
        check_config(config, gpt_config(config), world_size=1)
