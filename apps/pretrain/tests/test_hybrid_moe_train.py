"""The trainer's build and step on hybrid-moe-tiny (Mamba + attention + MoE) at ep 2 equal one process."""

from __future__ import annotations

import pytest
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
EXPERTS = 8

# one MoE layer's routing of one micro-batch: (layer index, tokens per expert, router loss)
Routed = tuple[int, torch.Tensor, float]


def _train(ep: int) -> tuple[list[float], list[str], int, dict[str, float], list[Routed]]:
    """Three steps at ``ep`` (dp = ep); returns the losses, the names of this rank's
    expert parameters (those the expert DDP owns), how many MoE layers it holds, the
    trainer's router statistics and this rank's routing in the last step."""
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
    routed: list[Routed] = []

    def record(index: int, moe: MoELayer) -> None:
        assert moe.last_stats is not None
        stats = moe.last_stats
        routed.append((index, stats.tokens_per_expert.cpu().clone(), float(stats.loss)))

    for chunk in built.chunks:
        for index, layer in chunk.layers.items():
            moe = getattr(layer, "mlp", None)
            if isinstance(moe, MoELayer):  # after each forward (no recompute here)
                moe.register_forward_hook(lambda m, _in, _out, i=int(index): record(i, m))
    losses = []
    for _ in range(STEPS):
        routed.clear()  # keep the last step's only
        losses.append(float(runner.train_step(batches, 3e-3)[0]))
    moe_layers = sum(isinstance(m, MoELayer) for c in built.chunks for m in c.modules())
    logged = moe_log_values(built.chunks, groups)  # the trainer's router statistics
    return losses, experts, moe_layers, logged, routed


def _pooled(routed: list[Routed]) -> dict[str, float]:
    """What the trainer logs when all of ``routed`` is one step's last micro-batch spread
    over dp ranks (the definitions of mega_pretrain.moe_logging)."""
    layers = sorted({i for i, _, _ in routed})
    counts = torch.stack(
        [torch.stack([c for i, c, _ in routed if i == layer]).double().sum(0) for layer in layers]
    )  # [moe layers, experts]: (token, expert) assignments summed over the micro-batches
    shares = counts / counts.sum(dim=1, keepdim=True)
    micro = len(routed) // len(layers)  # micro-batches (dp ranks' shares) pooled
    return {
        "moe_aux_loss": sum(loss for _, _, loss in routed) / micro,
        "moe_load_min": float(shares.min()),
        "moe_load_max": float(shares.max()),
        "moe_imbalance": float(shares.max(dim=1).values.max() * EXPERTS),
    }


def test_hybrid_moe_trains_at_ep2_like_one_process(dist_pool: DistPool) -> None:
    [(reference, ref_experts, ref_layers, ref_logged, ref_routed)] = dist_pool.run(
        _train, 1, args=(1,)
    )
    assert ref_layers == 2
    assert set(ref_logged) == {"moe_aux_loss", "moe_load_min", "moe_load_max", "moe_imbalance"}
    assert ref_experts == [f"layers.{i}.mlp.experts.weight{w}" for i in (3, 7) for w in (1, 2)]
    # one process, two micro-batches of the last step: it logs the second one's routing
    assert [i for i, _, _ in ref_routed] == [3, 7, 3, 7]
    assert ref_logged == pytest.approx(_pooled(ref_routed[2:]), rel=1e-12)
    # at ep 2 (dp 2) the last micro-batch is both micro-batches above, one on each rank:
    # the same tokens routed by the same router weights (equal to ~1e-6 after three steps,
    # far from flipping a top-2 choice), so equal counts; the router losses of fp32 sums in
    # another order, as the training losses below
    expected = _pooled(ref_routed)
    for logged in (ref_logged, expected):
        assert logged["moe_load_min"] <= 1 / EXPERTS <= logged["moe_load_max"]
        assert logged["moe_imbalance"] >= 1.0 and logged["moe_aux_loss"] > 0
    for losses, experts, layers, logged, _ in dist_pool.run(_train, 2, args=(2,)):
        assert experts == ref_experts and layers == 2  # each rank: half of every layer's experts
        assert set(logged) == set(expected)
        for key, value in expected.items():
            assert logged[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        # fp32 on CPU: the same sums in another order (see test_train_e2e.py)
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-5
        )
    assert reference[-1] < reference[0]
