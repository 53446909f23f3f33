"""``train.fp8``: the tiny GPT trains with its linear GEMMs in (emulated) FP8 on CPU.

Three AdamW steps on one fixed batch, bf16 parameters, with and without fp8. The fp8 run
differs from the bf16 one only in the rounding of the layers' GEMM operands: e4m3 for
inputs/weights (relative error <= 2^-4 per element), e5m2 for gradients (<= 2^-3). These
errors have random signs, so a dot product of K terms moves by about 2^-4 / sqrt(K) of its
magnitude (K = 64..256 here: ~1%), and the loss, a mean over 64 tokens of a smooth function
of the logits, moves less; Adam's update size does not depend on the gradient's scale, so
the three steps change the weights by the same amounts up to those rounding differences.
Hence losses within 3% of the bf16 run at every step (measured here: 0.002%, 0.13%, 1.0%).
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
from mega_tp_layers import ColumnParallelLinear, Fp8Recipe, RowParallelLinear

SEQ, MICRO, STEPS = 32, 2, 3  # 64 tokens per GEMM: a multiple of 16, so no fallback


def _losses(fp8: bool) -> tuple[list[float], int]:
    config = load_config(None, [("model.size", "tiny"), ("train.seq_len", str(SEQ)),
                                ("train.micro_batch_size", str(MICRO)),
                                ("train.global_batch_size", str(MICRO)),
                                ("train.precision", "bf16"), ("train.fp8", str(fp8).lower())])  # fmt: skip
    model = gpt_config(config)
    check_config(config, model, world_size=1)
    groups = init_process_groups(parallel_config(config))
    dev = rank_device()
    built = build(config, groups, dev)
    chunk = built.chunks[0]
    assert isinstance(chunk, GPTModel)
    fp8_layers = sum(
        isinstance(m, ColumnParallelLinear | RowParallelLinear) and isinstance(m.fp8, Fp8Recipe)
        for m in chunk.modules()
    )
    assert chunk.output is None or chunk.output.fp8 is None  # the head stays high precision
    runner = StepRunner(built, groups, seq_len=SEQ, micro_batch_size=MICRO,
                        hidden_size=model.hidden_size, dtype=param_dtype(config), device=dev,
                        sequence_parallel=False)  # fmt: skip
    tokens = torch.randint(
        0, model.vocab_size, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(0)
    )
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    losses = [float(runner.train_step(batch, 3e-3)[0]) for _ in range(STEPS)]
    return losses, fp8_layers


def test_fp8_trains_like_bf16(dist_pool: DistPool) -> None:
    [(bf16, bf16_layers)] = dist_pool.run(_losses, 1, args=(False,))
    [(fp8, fp8_layers)] = dist_pool.run(_losses, 1, args=(True,))
    assert bf16_layers == 0 and fp8_layers == 4 * 8  # qkv, proj, fc1, fc2 in each of 8 layers
    assert fp8[-1] < fp8[0] and bf16[-1] < bf16[0]
    torch.testing.assert_close(torch.tensor(fp8), torch.tensor(bf16), rtol=0.03, atol=0.0)
    assert fp8 != bf16  # the GEMMs really ran in fp8


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ([("train.precision", "fp32")], r"train.fp8 needs train.precision bf16, not fp32"),
        (
            [("train.precision", "bf16"), ("model.size", "hybrid-tiny")],
            r"GPT models only, not hybrid",
        ),
    ],
    ids=["fp32", "hybrid"],
)
def test_fp8_config_errors(overrides: list[tuple[str, str]], pattern: str) -> None:
    config = load_config(None, [("train.fp8", "true"), *overrides])
    with pytest.raises(ValueError, match=pattern) as info:
        check_config(config, gpt_config(config), world_size=1)
    assert re.search(r"; ", str(info.value))  # the way out follows the problem
