"""Contract: the tiny GPT trained with ZeRO-2 and ZeRO-3 over dp ranks equals one process.

mega-models' GPTModel (2 layers, hidden 64, vocab 257, tied embeddings) under
mega-zero-optim's DistributedDataParallel with ``sharding`` "gradients" or "parameters"
(gather units: the transformer layers; the embedding, the final norm and the tied head
stay in the root unit) and the DistributedOptimizer (AdamW, clipping at 1.0), 3 steps of a
global batch of 8 sequences in micro-batches of 2, against plain ``torch.optim.AdamW`` on
one process. Losses, clipped gradient norms and the full weights after the last step are
compared with the rounding bounds of the GPT layout contract (``_tolerance``'s reduction
lengths, Adam's eps 1e-5 for the reason given there). tp 2 composes: the dp shards are
shards of the tp shards.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from _tolerance import forward_reduction_length, model_reduction_length

from mega_models import GPTConfig, GPTModel, gather_full_state
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import (
    DistPool,
    assert_close_to_reference,
    rank_device,
    solo_groups,
)
from mega_zero_optim import DistributedDataParallel, DistributedOptimizer

STEPS, SEQ, MICRO, GLOBAL = 3, 16, 2, 8
LR, EPS, CLIP, DECAY, SEED = 1e-3, 1e-5, 1.0, 0.1, 5
CONFIG = GPTConfig(num_layers=2, tie_embeddings=True)


def _batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL, SEQ + 1), generator=gen)
    return [
        (tokens[i : i + MICRO, :-1], tokens[i : i + MICRO, 1:]) for i in range(0, GLOBAL, MICRO)
    ]


def _adamw(net: torch.nn.Module) -> torch.optim.AdamW:
    decay = [p for p in net.parameters() if p.dim() >= 2]
    no_decay = [p for p in net.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, eps=EPS)


def _reference() -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    dev = rank_device()
    net = GPTModel(CONFIG, solo_groups(), seed=SEED, device=dev)
    opt = _adamw(net)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        batches = _batches(step)
        total = 0.0
        for tokens, labels in batches:
            loss = net(tokens.to(dev), labels.to(dev)).mean() / len(batches)
            loss.backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        opt.step()
        losses.append(total)
    assert min(norms) > CLIP, "clipping must act for the norm to matter"
    state = gather_full_state([net])
    assert state is not None
    return losses, norms, state


def _parallel(
    sharding: str, tp: int, each_micro: bool, recompute: str
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    groups = init_process_groups(ParallelConfig(tp=tp))
    dev = rank_device()
    net = GPTModel(CONFIG, groups, seed=SEED, device=dev, recompute=recompute)  # type: ignore[arg-type]
    ddp = DistributedDataParallel(
        net,
        dp_group=groups.dp,
        bucket_size=20_000,
        sharding=sharding,
        gather_units=list(net.layers.values()) if sharding == "parameters" else None,
    )
    opt = DistributedOptimizer(_adamw(net), ddp, max_grad_norm=CLIP)
    dp, dp_rank = groups.size("dp"), groups.rank("dp")
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        batches = _batches(step)
        mine = batches[dp_rank::dp]
        total = torch.zeros((), device=dev)
        for m, (tokens, labels) in enumerate(mine):
            last = m == len(mine) - 1
            with nullcontext() if last or each_micro else ddp.no_sync():
                loss = ddp(tokens.to(dev), labels.to(dev)).mean() / len(mine)  # dp averages
                loss.backward()
            total += loss.detach()
        torch.distributed.all_reduce(total, group=groups.dp)
        result = opt.step()
        assert result.updated
        losses.append(float(total) / dp)
        norms.append(result.grad_norm)
    report, padded = opt.memory_report(), ddp.bucket_info()[-1].end  # one fp32 buffer
    assert report.grad_bytes == 4 * padded // dp  # only the gradient shards persist
    if sharding == "parameters":
        assert report.param_bytes == 4 * padded // dp  # ... and the parameter shards
    with ddp.gathered_parameters():
        state = gather_full_state([net])
    assert state is not None
    return losses, norms, state


CASES = [
    ("gradients", 1, 2, False, "none"),
    ("gradients", 1, 4, False, "none"),
    ("parameters", 1, 2, False, "none"),
    ("parameters", 1, 2, True, "none"),  # every micro-batch reduce-scatters into the shard
    ("parameters", 1, 4, False, "none"),
    ("parameters", 2, 2, False, "none"),  # shards of tp shards
    ("parameters", 1, 2, False, "full"),  # a recomputed layer gathers again in backward
]


@pytest.mark.parametrize(
    ("sharding", "tp", "dp", "each_micro", "recompute"),
    CASES,
    ids=[
        f"{s}-tp{t}-dp{d}{'-each-micro' if e else ''}{'' if r == 'none' else '-recompute'}"
        for s, t, d, e, r in CASES
    ],
)
def test_gpt_zero_stage_matches_single_process(
    dist_pool: DistPool, sharding: str, tp: int, dp: int, each_micro: bool, recompute: str
) -> None:
    ref_losses, ref_norms, ref_state = dist_pool.run(_reference, 1)[0]
    forward = forward_reduction_length(CONFIG, seq=SEQ)
    grad = model_reduction_length(CONFIG, seq=SEQ, tokens=GLOBAL * SEQ)
    for losses, norms, state in dist_pool.run(
        _parallel, tp * dp, args=(sharding, tp, each_micro, recompute)
    ):
        assert_close_to_reference(
            torch.tensor(losses), torch.tensor(ref_losses), reduction_length=forward, name="losses"
        )
        assert_close_to_reference(
            torch.tensor(norms), torch.tensor(ref_norms), reduction_length=grad, name="grad norms"
        )
        assert set(state) == set(ref_state)
        for name, value in state.items():
            assert_close_to_reference(
                value, ref_state[name], reduction_length=STEPS * grad, name=name
            )
