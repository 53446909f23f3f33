"""Full recompute routes each token twice: MoE routers count their expert load once.

The aux-loss-free bias moves by ``sign(mean_load - load)``, which a uniform doubling would
not change; the load itself (logged, and any magnitude-based rule) must be the forward's.
"""

from __future__ import annotations

import torch

from mega_models import GPTModel, model_config
from mega_moe import TopKRouter, is_recomputing, recomputing
from mega_parallel_grid.testing import DistPool, rank_device, solo_groups

SEQ, BATCH = 16, 2
MOE = {
    "hidden_size": 32, "num_layers": 2, "num_attention_heads": 4, "num_query_groups": 2,
    "num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 32, "moe_expert_bias": True,
}  # fmt: skip


def _loads() -> list[list[list[int]]]:
    config = model_config("tiny").replace(**MOE)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=gen)
    out = []
    for mode in ("none", "full"):
        model = GPTModel(config, solo_groups(), seed=3, recompute=mode, device=rank_device())  # type: ignore[arg-type]
        loss = model(tokens[:, :-1].to(rank_device()), tokens[:, 1:].to(rank_device()))
        loss.mean().backward()
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        assert len(routers) == 2
        out.append([r.load.tolist() for r in routers])
    return out


def test_full_recompute_counts_the_load_once(dist_pool: DistPool) -> None:
    [(plain, recomputed)] = dist_pool.run(_loads, 1)
    assert plain == recomputed
    assert all(sum(load) == SEQ * BATCH * 2 for load in plain)  # every token, top-2


def test_recomputing_marks_and_restores() -> None:
    assert not is_recomputing()
    with recomputing():
        assert is_recomputing()
        with recomputing():
            assert is_recomputing()
        assert is_recomputing()
    assert not is_recomputing()
