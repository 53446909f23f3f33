"""``train.loss_chunk_size``: the trainer with the fused output layer + loss trains like
without it (CPU, fp32): the same losses over 3 AdamW steps and the same weights after
them, for GPT (untied, tied, MTP, compiled, tp 2 + SP) and a hybrid.

Each case builds the model twice in one worker, with the option off and on, at the same
layout; chunks (5, 7) do not divide the 2 x 16 tokens of a micro-batch. The tolerance is
``assert_close_to_reference`` with n = the model's reduction chain over all steps
(``_tolerance.model_reduction_length``): the fused head sums the same products in another
order (chunked softmax statistics, the weight gradient summed chunk by chunk). Adam's eps
is 1e-5 for the reason ``tests/test_gpt_training_layouts.py`` gives (a nearly cancelling
gradient's rounding must not flip a whole update).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _tolerance import model_reduction_length

from mega_models import head
from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_pretrain.build import build, gpt_config, parallel_config
from mega_pretrain.config import load_config
from mega_pretrain.step import StepRunner
from mega_pretrain.validate import check_config

SEQ, MICRO, STEPS = 16, 2, 3

TWO = ("model.num_layers", "2")
CASES: dict[str, tuple[int, list[tuple[str, str]]]] = {
    "tp1": (1, [TWO, ("train.loss_chunk_size", "5")]),
    "tp2-sp": (2, [TWO, ("train.loss_chunk_size", "7"), ("parallel.sequence_parallel", "true")]),
    "tied": (1, [TWO, ("train.loss_chunk_size", "5"), ("model.tie_embeddings", "true")]),
    "mtp": (1, [TWO, ("train.loss_chunk_size", "7"), ("model.mtp_num_layers", "1")]),
    "compiled": (1, [TWO, ("train.loss_chunk_size", "5"), ("train.compile", "true")]),
    "hybrid": (1, [("model.size", "hybrid-tiny"), ("model.pattern", "M*-"),
                   ("train.loss_chunk_size", "5")]),
}  # fmt: skip


def _overrides(extra: list[tuple[str, str]], tp: int) -> list[tuple[str, str]]:
    return [
        ("model.size", "tiny"), ("parallel.tp", str(tp)),
        ("train.seq_len", str(SEQ)), ("train.micro_batch_size", str(MICRO)),
        ("train.global_batch_size", str(MICRO)), ("train.eps", "1e-5"), *extra,
    ]  # fmt: skip


def _train(overrides: list[tuple[str, str]]) -> tuple[list[float], list[torch.Tensor], int]:
    """Losses, parameters after the steps, and how often the fused loss was called (traced)."""
    calls = [0]
    fused = head.fused_linear_cross_entropy

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return fused(*args, **kwargs)

    head.fused_linear_cross_entropy = counted  # type: ignore[assignment]
    try:
        losses, weights = _steps(overrides)
    finally:
        head.fused_linear_cross_entropy = fused  # type: ignore[assignment]
    return losses, weights, calls[0]


def _steps(overrides: list[tuple[str, str]]) -> tuple[list[float], list[torch.Tensor]]:
    config = load_config(None, overrides)
    model = gpt_config(config)
    groups = init_process_groups(parallel_config(config))
    dev = rank_device()
    built = build(config, groups, dev)
    runner = StepRunner(built, groups, seq_len=SEQ, micro_batch_size=MICRO,
                        hidden_size=model.hidden_size, dtype=torch.float32, device=dev,
                        sequence_parallel=config.parallel.sequence_parallel)  # fmt: skip
    tokens = torch.randint(
        0, model.vocab_size, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(0)
    )
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    losses = [float(runner.train_step(batch, 1e-3)[0]) for _ in range(STEPS)]
    torch._dynamo.reset()
    return losses, [p.detach().clone() for p in built.ddp.parameters()]


def _compare(tp: int, extra: list[tuple[str, str]]) -> None:
    fused = _overrides(extra, tp)
    plain = [(k, v) for k, v in fused if k != "train.loss_chunk_size"]
    gpt = gpt_config(load_config(None, fused))
    n = model_reduction_length(gpt, seq=SEQ, tokens=MICRO * SEQ, steps=STEPS)
    losses, weights, calls = _train(fused)
    ref_losses, ref_weights, ref_calls = _train(plain)
    assert calls > 0 and ref_calls == 0, (calls, ref_calls)  # the option reached the head
    assert_close_to_reference(torch.tensor(losses), torch.tensor(ref_losses),
                              reduction_length=n, name="losses")  # fmt: skip
    assert len(weights) == len(ref_weights)
    for i, (w, ref) in enumerate(zip(weights, ref_weights, strict=True)):
        assert_close_to_reference(w, ref, reduction_length=n, name=f"parameter {i}")


@pytest.mark.parametrize("case", list(CASES))
def test_fused_loss_trains_like_the_unfused_head(dist_pool: DistPool, case: str) -> None:
    tp, extra = CASES[case]
    dist_pool.run(_compare, tp, args=(tp, extra), timeout=600)


def test_negative_loss_chunk_size_is_refused() -> None:
    config = load_config(None, [("train.loss_chunk_size", "-1")])
    with pytest.raises(ValueError, match=r"train.loss_chunk_size \(-1\) must be 0 \(off\)"):
        check_config(config, gpt_config(config), world_size=1)
