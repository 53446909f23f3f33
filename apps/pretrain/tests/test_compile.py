"""``train.compile``: compiled layers and head train like the eager model (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from mega_models import lm_head
from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_pretrain.build import build, gpt_config, parallel_config
from mega_pretrain.config import load_config
from mega_pretrain.step import StepRunner

SEQ, MICRO, STEPS = 16, 2, 2


#: each family at its smallest: every layer kind once (compiling costs seconds a layer)
_SMALL = {
    "tiny": [("model.num_layers", "2")],
    "moe-tiny": [("model.num_layers", "2"), ("model.moe_layer_pattern", "-E")],
    "mixtral-tiny": [("model.num_layers", "1")],
    "hybrid-tiny": [("model.pattern", "M*-")],
    "hybrid-moe-tiny": [("model.pattern", "M*E")],
}


def _losses(
    compile_: bool, recompute: str = "none", dropout: float = 0.0, size: str = "tiny"
) -> tuple[list[float], bool, dict[str, int]]:
    config = load_config(None, [("model.size", size), *_SMALL[size],
                                ("train.seq_len", str(SEQ)), ("train.micro_batch_size", str(MICRO)),
                                ("train.global_batch_size", str(MICRO)),
                                ("train.recompute", recompute),
                                ("model.attention_dropout", str(dropout)),
                                ("model.hidden_dropout", str(dropout)),
                                ("train.compile", str(compile_).lower())])  # fmt: skip
    model = gpt_config(config)
    groups = init_process_groups(parallel_config(config))
    dev = rank_device()
    built = build(config, groups, dev)
    head_compiled = built.chunks[0].head_fn is not lm_head
    runner = StepRunner(built, groups, seq_len=SEQ, micro_batch_size=MICRO,
                        hidden_size=model.hidden_size, dtype=torch.float32, device=dev,
                        sequence_parallel=False)  # fmt: skip
    tokens = torch.randint(
        0, model.vocab_size, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(0)
    )
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    torch._dynamo.utils.counters.clear()
    losses = [float(runner.train_step(batch, 1e-3)[0]) for _ in range(STEPS)]
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    torch._dynamo.reset()
    return losses, head_compiled, breaks


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_compiled_model_trains_like_eager(dist_pool: DistPool, recompute: str) -> None:
    [(eager, eager_head, _)] = dist_pool.run(_losses, 1, args=(False, recompute))
    [(compiled, compiled_head, _)] = dist_pool.run(_losses, 1, args=(True, recompute))
    assert not eager_head and compiled_head
    # fp32: the compiler fuses and reorders the same arithmetic (e.g. RMSNorm's sum)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_compiled_model_with_dropout_and_recompute_trains(
    dist_pool: DistPool, recompute: str
) -> None:
    """Dropout's masks come from the compiler's RNG, so the losses are not eager's; the
    recomputation that replays the tracked RNG (outside the compiled graph) must run."""
    [(losses, _, _)] = dist_pool.run(_losses, 1, args=(True, recompute, 0.1))
    [(plain, _, _)] = dist_pool.run(_losses, 1, args=(True, recompute, 0.0))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses != plain  # dropout acted


@pytest.mark.parametrize("size", ["moe-tiny", "mixtral-tiny", "hybrid-tiny", "hybrid-moe-tiny"])
def test_every_family_compiles_without_graph_breaks(dist_pool: DistPool, size: str) -> None:
    """The trainer's compile path (per layer + head) for the MoE and hybrid families: the
    compiled losses are the eager ones, and no compiled region breaks its graph (a host
    read of the MoE counts, a pinned copy or a pointer check used to)."""
    [(eager, _, _)] = dist_pool.run(_losses, 1, args=(False, "none", 0.0, size))
    [(compiled, head, breaks)] = dist_pool.run(
        _losses, 1, args=(True, "none", 0.0, size), timeout=600
    )
    assert head
    assert breaks == {}, f"{size}: graph breaks {breaks}"
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=1e-5)
