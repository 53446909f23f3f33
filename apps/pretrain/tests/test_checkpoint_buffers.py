"""MoE expert biases (buffers, not parameters) survive a checkpoint round trip."""

from __future__ import annotations

from pathlib import Path

import torch

from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_pretrain.build import build, gpt_config, parallel_config
from mega_pretrain.checkpoint import load_checkpoint, save_checkpoint
from mega_pretrain.config import load_config
from mega_pretrain.step import StepRunner


def _round_trip(run_dir: str) -> tuple[int, bool]:
    config = load_config(None, [("model.size", "moe-tiny"), ("train.seq_len", "16"),
                                ("train.micro_batch_size", "2"), ("train.global_batch_size", "2")])  # fmt: skip
    groups = init_process_groups(parallel_config(config))
    dev = rank_device()
    built = build(config, groups, dev)
    model = gpt_config(config)
    runner = StepRunner(built, groups, seq_len=16, micro_batch_size=2, hidden_size=model.hidden_size,
                        dtype=torch.float32, device=dev, sequence_parallel=False)  # fmt: skip
    tokens = torch.randint(0, model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        runner.train_step([(tokens[:, :-1], tokens[:, 1:])], 1e-3)
    biases = {n: b.clone() for n, b in built.chunks[0].named_buffers() if n.endswith("expert_bias")}
    assert biases and any(
        bool(b.abs().sum() > 0) for b in biases.values()
    )  # the updates moved them
    path = save_checkpoint(Path(run_dir), 2, built, groups, {"step": 2, "consumed_samples": 4})
    fresh = build(config, groups, dev)
    load_checkpoint(path, fresh, groups)
    loaded = dict(fresh.chunks[0].named_buffers())
    same = all(torch.equal(loaded[n], b) for n, b in biases.items())
    return len(biases), same


def test_expert_biases_are_restored(dist_pool: DistPool, tmp_path: Path) -> None:
    count, same = dist_pool.run(_round_trip, 1, args=(str(tmp_path),))[0]
    assert count > 0 and same
