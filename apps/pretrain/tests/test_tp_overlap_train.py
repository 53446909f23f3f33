"""``parallel.tp_comm_overlap``: tiny GPT at tp 2 + SP trains the same with and without it.

Build + three AdamW steps on one fixed batch, fp32, 2 ranks. With the overlap each
sequence-parallel all-gather / reduce-scatter runs as a ring of chunks around its GEMM,
which computes row slices of the same GEMM; at tp = 2 the only sum over ranks has two
terms (a + b == b + a), and CPU BLAS rounds a row slice as the whole GEMM, so the losses
are bitwise equal (the layer tests in mega-tp-layers check the same per tensor).
"""

from __future__ import annotations

import re

import pytest
import torch

from mega_models import GPTModel
from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_pretrain.build import build, gpt_config, parallel_config, param_dtype
from mega_pretrain.config import load_config
from mega_pretrain.step import StepRunner
from mega_pretrain.validate import check_config
from mega_tp_layers import ColumnParallelLinear, RowParallelLinear

SEQ, MICRO, STEPS = 16, 2, 3


def _losses(overlap: bool) -> tuple[list[float], int]:
    config = load_config(None, [("model.size", "tiny"), ("train.seq_len", str(SEQ)),
                                ("train.micro_batch_size", str(MICRO)),
                                ("train.global_batch_size", str(MICRO)),
                                ("train.precision", "fp32"), ("parallel.tp", "2"),
                                ("parallel.sequence_parallel", "true"),
                                ("parallel.tp_comm_overlap", str(overlap).lower())])  # fmt: skip
    model = gpt_config(config)
    check_config(config, model, world_size=2)
    groups = init_process_groups(parallel_config(config))
    dev = rank_device()
    built = build(config, groups, dev)
    chunk = built.chunks[0]
    assert isinstance(chunk, GPTModel)
    overlapped = sum(
        isinstance(m, ColumnParallelLinear | RowParallelLinear) and m.tp_comm_overlap
        for m in chunk.modules()
    )
    runner = StepRunner(built, groups, seq_len=SEQ, micro_batch_size=MICRO,
                        hidden_size=model.hidden_size, dtype=param_dtype(config), device=dev,
                        sequence_parallel=True)  # fmt: skip
    tokens = torch.randint(
        0, model.vocab_size, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(0)
    )
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    losses = [float(runner.train_step(batch, 3e-3)[0]) for _ in range(STEPS)]
    return losses, overlapped


def test_overlap_trains_exactly_like_plain_sequence_parallel(dist_pool: DistPool) -> None:
    plain = dist_pool.run(_losses, 2, args=(False,))
    overlap = dist_pool.run(_losses, 2, args=(True,))
    layers = gpt_config(load_config(None, [("model.size", "tiny")])).num_layers
    assert plain[0][1] == 0 and overlap[0][1] == 4 * layers  # qkv, proj, fc1, fc2 per layer
    assert len(set(plain[0][0])) == STEPS  # the steps really changed the weights
    for (base, _), (over, _) in zip(plain, overlap, strict=True):
        assert over == base, (over, base)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ([("parallel.tp", "2")], r"needs parallel.sequence_parallel true and tp > 1 \(got "
                                 r"sequence_parallel=false, tp=2\)"),
        ([], r"tp > 1 \(got sequence_parallel=false, tp=1\)"),
        (
            [("parallel.tp", "2"), ("parallel.sequence_parallel", "true"),
             ("model.size", "hybrid-tiny")],
            r"GPT models only, not hybrid",
        ),
    ],
    ids=["no-sp", "tp1", "hybrid"],
)  # fmt: skip
def test_overlap_config_errors(overrides: list[tuple[str, str]], pattern: str) -> None:
    config = load_config(None, [("parallel.tp_comm_overlap", "true"), *overrides])
    with pytest.raises(ValueError, match=pattern) as info:
        check_config(config, gpt_config(config), world_size=2)
    assert re.search(r"; ", str(info.value))  # the way out follows the problem
