"""Contract: ZeRO-2 and ZeRO-3 through the trainer (``parallel.sharding``) equal one process.

The trainer's own ``build`` and ``StepRunner`` train the tiny GPT of
``test_gpt_training_layouts`` (cut to 4 layers; hidden 64, vocab 257) for 3 AdamW steps with
gradient accumulation (2 micro-batches per dp rank at dp 2), clipping at 1.0, against the
same plain single-process reference, with the same rounding bounds (see that file).
ZeRO-3's full weights are read inside ``Built.gathered_parameters``. The MoE cases reuse
``test_moe_training``'s check (its expert weights are sharded over expert-dp). Beside the
numbers, each ZeRO-3 run checks that only the parameter shards stay allocated between
steps (what the memory formula counts).
"""

from __future__ import annotations

from typing import Any

import pytest
import test_gpt_training_layouts as layouts
import test_moe_training as moe
import torch
from _reference_cache import reference_once

from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_pretrain.build import Built, build, gpt_config, parallel_config
from mega_pretrain.config import load_config
from mega_pretrain.step import StepRunner
from mega_pretrain.validate import check_config
from mega_zero_optim.sharded_buffer import ShardedBuffer

Result = tuple[list[float], list[float], dict[str, torch.Tensor]]


def _parallel(
    layout: dict[str, object], model: dict[str, object], train: dict[str, str] | None = None
) -> Result:
    train = train or {}
    extra = [(f"train.{k}", v) for k, v in train.items()]
    config = load_config(None, layouts._overrides(layout, model) + extra)
    gpt = gpt_config(config)
    check_config(config, gpt, torch.distributed.get_world_size())
    groups = init_process_groups(parallel_config(config))
    dev = rank_device()
    built = build(config, groups, dev)
    micro = layouts._micro(layout)
    runner = StepRunner(
        built, groups, seq_len=layouts.SEQ, micro_batch_size=micro,
        hidden_size=gpt.hidden_size, dtype=torch.float32, device=dev,
        sequence_parallel=config.parallel.sequence_parallel,
    )  # fmt: skip
    dp, dp_rank = groups.size("dp"), groups.rank("dp")
    losses, norms = [], []
    torch._dynamo.utils.counters.clear()
    for step in range(layouts.STEPS):
        mine = layouts._batches(7, step, micro)[dp_rank::dp]
        loss, result = runner.train_step(mine, layouts.LR)
        assert result.updated
        losses.append(float(loss))
        norms.append(result.grad_norm)
    if config.train.compile:  # ZeRO-3's gather hooks stay outside the compiled layers
        breaks = dict(torch._dynamo.utils.counters["graph_break"])
        torch._dynamo.reset()
        assert breaks == {}, f"graph breaks {breaks}"
    for ddp in built.ddps:
        assert ddp.sharding == (
            config.parallel.zero_stage if ddp is not built.whole_ddp else "optimizer"
        )
        for buffer in ddp.param_and_grad_buffers:
            if ddp.sharding != "optimizer":  # between steps only the shards are allocated
                assert isinstance(buffer, ShardedBuffer)
                assert buffer.grad_bytes == buffer.grad_shard_data.numel() * 4
                if ddp.sharding == "parameters":
                    assert buffer.param_bytes == buffer.numel // ddp.dp_size * 4
    with built.gathered_parameters():
        weights = layouts._full_weights(built.chunks)
    return losses, norms, weights


def _check(
    dist_pool: DistPool,
    layout: dict[str, object],
    model: dict[str, object],
    dp: int = 2,
    train: dict[str, str] | None = None,
) -> None:
    model = {**SMALL, **model}
    reference = reference_once(dist_pool, layouts._reference, model)
    results = dist_pool.run(
        _parallel, layouts._world(layout, dp), args=(layout, model, train), timeout=600
    )
    layouts._assert_matches(results, reference, model)


#: The layout suite's tiny GPT at 4 layers (still a unit per layer to gather and prefetch, and
#: one per virtual stage at pp 2 x vpp 2): ZeRO-3 runs a gather and a reduce-scatter per layer
#: and micro-batch, which 8 layers made the suite's slowest file.
SMALL: dict[str, object] = {"num_layers": 4}

#: Each mechanism once: ZeRO-2 and ZeRO-3 keep the tp/pp/tied/W-pass gradients whole or
#: reduce them through the same code (``mega_pretrain.build._wrap``), so the compositions run
#: at ZeRO-3, the stage that also gathers; ZeRO-2 runs alone, tied and under HSDP.
CASES: list[tuple[dict[str, object], dict[str, object]]] = [
    ({"sharding": "gradients"}, {}),
    ({"sharding": "parameters"}, {}),
    ({"sharding": "optim_grads_params"}, {"tie_embeddings": True}),  # Megatron's name
    ({"sharding": "parameters", "pp": 2, "vpp": 2}, {}),
    ({"sharding": "parameters", "pp": 2}, {"tie_embeddings": True}),
    ({"sharding": "parameters", "cp": 2}, {}),
    ({"sharding": "parameters", "pp": 2, "pp_schedule": "zb-h1"}, {}),  # W passes deferred
    # SP norms' and QK-norm's tp replicas at ZeRO-3 (4 ranks; tp x pp composes in the cases
    # above, 8 ranks of it cost ~80 s of the suite's 2 cores)
    ({"sharding": "parameters", "tp": 2, "sequence_parallel": True}, {"qk_norm": True}),
    ({"optimizer_offload": True}, {}),  # masters and moments on the host, the CPU's fused AdamW
    ({"sharding": "parameters", "optimizer_offload": True}, {}),
]


@pytest.mark.parametrize(
    ("layout", "model"),
    CASES,
    ids=["-".join(f"{k}{v}" for k, v in {**lay, **mod}.items()) + "-dp2" for lay, mod in CASES],
)
def test_zero_stage_trains_like_one_process(
    dist_pool: DistPool, layout: dict[str, object], model: dict[str, object]
) -> None:
    _check(dist_pool, layout, model)


def test_zero3_compiled_layers_train_like_one_process(dist_pool: DistPool) -> None:
    """``train.compile`` (each layer compiled, the head too) at ZeRO-3 dp 2 with full
    recompute (the recomputed forward gathers again): 2 layers, since compiling on the CPU
    costs seconds a graph (mega-zero-optim's test_zero3_compile runs it without recompute)."""
    train = {"compile": "true", "recompute": "full"}
    _check(dist_pool, {"sharding": "parameters"}, {"num_layers": 2}, train=train)


#: HSDP at ZeRO-3 through the trainer; mega-zero-optim's HSDP contract runs every stage
HSDP_CASES = [{"sharding": "parameters", "dp_shard": 2}]


@pytest.mark.parametrize("layout", HSDP_CASES, ids=lambda d: f"{d['sharding']}-dp_shard2")
def test_hsdp_trains_like_one_process(dist_pool: DistPool, layout: dict[str, object]) -> None:
    """dp 4 = 2 shards x 2 replicas, one micro-batch per rank."""
    _check(dist_pool, layout, {}, dp=4)


MOE_CASES = [
    ({"ep": 2, "sharding": "gradients"}, 4),  # ep2 folded over dp4: experts over edp 2
    ({"ep": 2, "pp": 2, "sharding": "gradients"}, 2),
    ({"ep": 2, "sharding": "parameters"}, 4),  # two gatherers: dense over dp, experts over edp
    # ZeRO-3 under the V schedule: each rank's two chunks gathered and reduced apart
    ({"ep": 2, "pp": 2, "vpp": 2, "pp_schedule": "zbv", "sharding": "parameters"}, 2),
]


@pytest.mark.parametrize(
    ("layout", "dp"),
    MOE_CASES,
    ids=["zero2-ep2-dp4", "zero2-ep2-pp2-dp2", "zero3-ep2-dp4", "zero3-ep2-zbv-dp2"],
)
def test_moe_zero_trains_like_one_process(
    dist_pool: DistPool, layout: dict[str, object], dp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(moe, "_parallel", _moe_parallel)  # the workers run it by name
    model = {**moe.MIXTRAL, "num_layers": 4} if "vpp" in layout else moe.MIXTRAL
    moe._check(dist_pool, layout, model, dp)


_MOE_PARALLEL = moe._parallel  # taken before any test replaces it


def _moe_parallel(*args: Any) -> Any:
    """test_moe_training's run, its full weights read inside ``gathered_parameters``."""
    built: list[Built] = []
    full_weights = moe._full_weights

    def recording(*a: Any, **k: Any) -> Built:
        built.append(build(*a, **k))
        return built[-1]

    def gathered(chunks: Any) -> Any:
        with built[-1].gathered_parameters():
            return full_weights(chunks)

    moe.build, moe._full_weights = recording, gathered
    try:
        return _MOE_PARALLEL(*args)
    finally:
        moe.build, moe._full_weights = build, full_weights
