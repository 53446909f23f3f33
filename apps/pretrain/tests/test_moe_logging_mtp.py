"""The trainer's router statistics count a DeepSeek-style MTP depth's MoE layer too."""

from __future__ import annotations

import pytest
import torch

from mega_moe import MoELayer
from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_pretrain.build import build, gpt_config, parallel_config
from mega_pretrain.config import load_config
from mega_pretrain.moe_logging import moe_log_values
from mega_pretrain.step import StepRunner

SEQ, MICRO = 32, 2


def _step() -> tuple[dict[str, float], list[tuple[str, torch.Tensor, float]], int]:
    config = load_config(None, [("model.size", "deepseek-v3-tiny"), ("train.seq_len", str(SEQ)),
                                ("train.micro_batch_size", str(MICRO)),
                                ("train.global_batch_size", str(MICRO))])  # fmt: skip
    model = gpt_config(config)
    groups = init_process_groups(parallel_config(config))
    built = build(config, groups, rank_device())
    runner = StepRunner(built, groups, seq_len=SEQ, micro_batch_size=MICRO,
                        hidden_size=model.hidden_size, dtype=torch.float32, device=rank_device(),
                        sequence_parallel=False)  # fmt: skip
    routed: list[tuple[str, torch.Tensor, float]] = []
    for chunk in built.chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, MoELayer):
                module.register_forward_hook(
                    lambda m, _i, _o, n=name: routed.append(
                        (
                            n,
                            m.last_stats.tokens_per_expert.double().clone(),
                            float(m.last_stats.loss),
                        )
                    )
                )
    tokens = torch.randint(
        0, model.vocab_size, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(0)
    )
    runner.train_step([(tokens[:, :-1], tokens[:, 1:])], 1e-3)
    return moe_log_values(built.chunks, groups), routed, model.num_experts


def test_router_statistics_include_the_mtp_depth(dist_pool: DistPool) -> None:
    [(logged, routed, experts)] = dist_pool.run(_step, 1)
    names = [name for name, _, _ in routed]
    assert names == ["layers.1.mlp", "layers.2.mlp", "layers.3.mlp", "mtp.0.layer.mlp"]
    counts = torch.stack([c for _, c, _ in routed])  # [4 MoE layers, experts]
    shares = counts / counts.sum(dim=1, keepdim=True)
    assert logged["moe_aux_loss"] == pytest.approx(sum(loss for _, _, loss in routed), rel=1e-12)
    assert logged["moe_load_min"] == pytest.approx(float(shares.min()), rel=1e-12)
    assert logged["moe_load_max"] == pytest.approx(float(shares.max()), rel=1e-12)
    assert logged["moe_imbalance"] == pytest.approx(
        float(shares.max(dim=1).values.max() * experts), rel=1e-12
    )
