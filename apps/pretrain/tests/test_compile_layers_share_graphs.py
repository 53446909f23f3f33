"""Compiled layers of one kind share one graph: a per-layer constant that dynamo guards on
(the experts' main-grad key was one until 2026-12-07) compiles each layer again, and past
dynamo's recompile limit (8) the further layers run uncompiled, silently: `deepseek-3b`'s
11 MoE layers did. Here the limit is lowered below the MoE layer count and a hit fails."""

from __future__ import annotations

import torch
import torch._dynamo

from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_pretrain.build import build, gpt_config, parallel_config
from mega_pretrain.config import load_config
from mega_pretrain.step import StepRunner

SEQ, MICRO = 16, 2
LAYERS = "-EEEEE"  # a dense layer, then five MoE layers: more than the limit below
LIMIT = 3


def _one_compiled_step() -> float:
    config = load_config(None, [("model.size", "moe-tiny"), ("model.num_layers", str(len(LAYERS))),
                                ("model.moe_layer_pattern", LAYERS), ("train.seq_len", str(SEQ)),
                                ("train.micro_batch_size", str(MICRO)),
                                ("train.global_batch_size", str(MICRO)),
                                ("train.precision", "fp32"), ("train.compile", "true")])  # fmt: skip
    model = gpt_config(config)
    groups = init_process_groups(parallel_config(config))
    device = rank_device()
    runner = StepRunner(build(config, groups, device), groups, seq_len=SEQ, micro_batch_size=MICRO,
                        hidden_size=model.hidden_size, dtype=torch.float32, device=device,
                        sequence_parallel=False)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (MICRO, SEQ + 1), generator=gen)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=LIMIT, fail_on_recompile_limit_hit=True):
        loss, _ = runner.train_step([(tokens[:, :-1].to(device), tokens[:, 1:].to(device))], 1e-3)
    return float(loss)


def test_moe_layers_share_one_graph(dist_pool: DistPool) -> None:
    [loss] = dist_pool.run(_one_compiled_step, 1)
    assert torch.isfinite(torch.tensor(loss))
