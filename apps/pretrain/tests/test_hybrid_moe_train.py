"""The trainer's build and step on hybrid-moe-tiny (Mamba + attention + MoE) at ep 2 equal one process."""

from __future__ import annotations

import torch

from mega_moe import MoELayer, expert_shard
from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_pretrain.build import build, gpt_config, parallel_config
from mega_pretrain.config import load_config
from mega_pretrain.moe_logging import moe_log_values
from mega_pretrain.step import StepRunner
from mega_pretrain.validate import check_config

SEQ, MICRO, GLOBAL, STEPS = 32, 2, 4, 3  # seq 32: two Mamba chunks of 16


def _train(ep: int) -> tuple[list[float], list[str], int, dict[str, float]]:
    """Three steps at ``ep`` (dp = ep); returns the losses, the names of this rank's
    expert parameters (those the expert DDP owns) and how many MoE layers it holds."""
    config = load_config(None, [("model.size", "hybrid-moe-tiny"), ("ep", str(ep)),
                                ("train.seq_len", str(SEQ)), ("train.micro_batch_size", str(MICRO)),
                                ("train.global_batch_size", str(GLOBAL)), ("train.eps", "1e-5")])  # fmt: skip
    model = gpt_config(config)
    world = torch.distributed.get_world_size()
    check_config(config, model, world)
    groups = init_process_groups(parallel_config(config))
    dev = rank_device()
    built = build(config, groups, dev)
    assert built.expert_ddp is not None
    experts = [n for c in built.chunks for n, p in c.named_parameters() if expert_shard(p)]
    runner = StepRunner(built, groups, seq_len=SEQ, micro_batch_size=MICRO,
                        hidden_size=model.hidden_size, dtype=torch.float32, device=dev,
                        sequence_parallel=False)  # fmt: skip
    dp, dp_rank = groups.size("dp"), groups.rank("dp")
    per_rank = GLOBAL // dp
    # one global batch, learnt by heart: the loss must fall
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (GLOBAL, SEQ + 1), generator=gen)
    mine = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]  # this dp rank's samples
    batches = [(b[:, :-1], b[:, 1:]) for b in mine.split(MICRO)]
    losses = [float(runner.train_step(batches, 3e-3)[0]) for _ in range(STEPS)]
    moe_layers = sum(isinstance(m, MoELayer) for c in built.chunks for m in c.modules())
    logged = moe_log_values(built.chunks, groups)  # the trainer's router statistics
    return losses, experts, moe_layers, logged


def test_hybrid_moe_trains_at_ep2_like_one_process(dist_pool: DistPool) -> None:
    [(reference, ref_experts, ref_layers, ref_logged)] = dist_pool.run(_train, 1, args=(1,))
    assert ref_layers == 2
    assert set(ref_logged) == {"moe_aux_loss", "moe_load_min", "moe_load_max", "moe_imbalance"}
    assert ref_logged["moe_load_min"] <= 1 / 8 <= ref_logged["moe_load_max"]  # 8 experts
    assert ref_logged["moe_imbalance"] >= 1.0
    assert ref_experts == [f"layers.{i}.mlp.experts.weight{w}" for i in (3, 7) for w in (1, 2)]
    for losses, experts, layers, logged in dist_pool.run(_train, 2, args=(2,)):
        assert set(logged) == set(ref_logged)
        assert experts == ref_experts and layers == 2  # each rank: half of every layer's experts
        # fp32 on CPU: the same sums in another order (see test_train_e2e.py)
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-5
        )
    assert reference[-1] < reference[0]
