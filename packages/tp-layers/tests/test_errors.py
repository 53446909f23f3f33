"""Bad input fails at once, in one sentence that names the numbers and the way out."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool
from mega_tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    fp8_autocast,
    vocab_parallel_cross_entropy,
)

S, B, H, FFN = 12, 2, 24, 48


def _message(fn: Callable[[], object]) -> tuple[str, str]:
    try:
        fn()
    except (ValueError, TypeError, ImportError) as exc:
        return type(exc).__name__, str(exc)
    return "none", "no error raised"


def _bad_inputs() -> dict[str, tuple[str, str]]:
    g = init_process_groups(ParallelConfig(tp=2)).tp
    col = ColumnParallelLinear(H, FFN, tp_group=g)
    row = RowParallelLinear(FFN, H, tp_group=g)
    col_sp = ColumnParallelLinear(H, FFN, tp_group=g, sequence_parallel=True)
    row_sp = RowParallelLinear(FFN, H, tp_group=g, sequence_parallel=True)
    emb_sp = VocabParallelEmbedding(10, H, tp_group=g, sequence_parallel=True)
    logits = torch.randn(S, B, 5)
    no_group: Any = None
    bad_backend: Any = "xla"
    saved = {k: sys.modules.get(k) for k in ("transformer_engine", "transformer_engine.pytorch")}
    sys.modules["transformer_engine"] = None  # type: ignore[assignment]  # simulate "not installed"
    sys.modules["transformer_engine.pytorch"] = None  # type: ignore[assignment]
    try:
        te_missing = _message(lambda: ColumnParallelLinear(H, FFN, tp_group=g, backend="te"))
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value
    return {
        "col_out": _message(lambda: ColumnParallelLinear(H, 25, tp_group=g)),
        "row_in": _message(lambda: RowParallelLinear(25, H, tp_group=g)),
        "row_sp_full_input": _message(
            lambda: RowParallelLinear(
                FFN, H, tp_group=g, sequence_parallel=True, input_is_parallel=False
            )
        ),
        "skip_and_gather": _message(
            lambda: ColumnParallelLinear(H, FFN, tp_group=g, skip_bias_add=True, gather_output=True)
        ),
        "no_group": _message(lambda: ColumnParallelLinear(H, FFN, tp_group=no_group)),
        "backend": _message(lambda: RowParallelLinear(FFN, H, tp_group=g, backend=bad_backend)),
        "te_missing": te_missing,
        "te_skip_bias_col": _message(
            lambda: ColumnParallelLinear(H, FFN, tp_group=g, backend="te", skip_bias_add=True)
        ),
        "te_skip_bias_row": _message(
            lambda: RowParallelLinear(FFN, H, tp_group=g, backend="te", skip_bias_add=True)
        ),
        "col_wrong_width": _message(lambda: col(torch.randn(S, B, H + 1))),
        "row_full_input": _message(lambda: row(torch.randn(S, B, FFN))),
        "col_sp_no_sequence": _message(lambda: col_sp(torch.randn(H))),
        "row_sp_seq": _message(lambda: row_sp(torch.randn(7, B, FFN // 2))),
        "emb_sp_seq": _message(lambda: emb_sp(torch.zeros(7, B, dtype=torch.long))),
        "emb_float_ids": _message(lambda: emb_sp(torch.zeros(S, B))),
        "ce_shape": _message(
            lambda: vocab_parallel_cross_entropy(logits, torch.zeros(S, 3).long(), g)
        ),
        "ce_float_targets": _message(
            lambda: vocab_parallel_cross_entropy(logits, torch.zeros(S, B), g)
        ),
        "ce_vocab": _message(
            lambda: vocab_parallel_cross_entropy(logits, torch.zeros(S, B).long(), g, vocab_size=11)
        ),
        "ce_smoothing": _message(
            lambda: vocab_parallel_cross_entropy(logits, torch.zeros(S, B).long(), g, 1.5)
        ),
    }


EXPECTED = {
    "col_out": (
        "ValueError",
        r"out_features \(25\) is not divisible by tp \(2\); choose a multiple of 2",
    ),
    "row_in": (
        "ValueError",
        r"in_features \(25\) is not divisible by tp \(2\); choose a multiple of 2",
    ),
    "row_sp_full_input": ("ValueError", r"sequence_parallel=True needs input_is_parallel=True"),
    "skip_and_gather": ("ValueError", r"skip_bias_add=True with gather_output=True"),
    "no_group": (
        "TypeError",
        r"needs tp_group to be a torch.distributed ProcessGroup, got NoneType",
    ),
    "backend": ("ValueError", r"backend 'xla' is not one of torch, te"),
    "te_skip_bias_col": (
        "ValueError",
        r"ColumnParallelLinear skip_bias_add=True is not supported with backend='te'",
    ),
    "te_skip_bias_row": (
        "ValueError",
        r"RowParallelLinear skip_bias_add=True is not supported with backend='te'",
    ),
    "te_missing": (
        "ImportError",
        r"backend='te' needs NVIDIA Transformer Engine, which is not installed",
    ),
    "col_wrong_width": (
        "ValueError",
        r"last dimension is in_features \(24\), got shape \(12, 2, 25\)",
    ),
    "row_full_input": (
        "ValueError",
        r"last dimension is in_features/tp \(24\), got shape \(12, 2, 48\)",
    ),
    "col_sp_no_sequence": ("ValueError", r"expects a sequence-first \[s, b, \.\.\.\] input"),
    "row_sp_seq": ("ValueError", r"sequence length \(7\) is not divisible by tp \(2\)"),
    "emb_sp_seq": ("ValueError", r"sequence length \(7\) is not divisible by tp \(2\)"),
    "emb_float_ids": ("TypeError", r"expects integer token ids, got dtype torch.float32"),
    "ce_shape": (
        "ValueError",
        r"logits shard shape \(12, 2, 5\) does not match targets shape \(12, 3\)",
    ),
    "ce_float_targets": ("TypeError", r"expects integer targets, got dtype torch.float32"),
    "ce_vocab": ("ValueError", r"vocab_size \(11\) must lie in \[1, 10\]"),
    "ce_smoothing": ("ValueError", r"label_smoothing \(1.5\) must lie in \[0, 1\]"),
}


@pytest.fixture(scope="module")
def messages(dist_pool: DistPool) -> dict[str, tuple[str, str]]:
    results: dict[str, tuple[str, str]] = dist_pool.run(_bad_inputs, 2)[0]
    return results


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_input_raises_one_sentence(messages: dict[str, tuple[str, str]], case: str) -> None:
    kind, text = messages[case]
    expected_kind, pattern = EXPECTED[case]
    assert kind == expected_kind, text
    assert re.search(pattern, text), text
    assert "\n" not in text


def test_fp8_autocast_without_te_says_how(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    with pytest.raises(ImportError, match=r"install transformer-engine\[pytorch\]") as info:
        fp8_autocast()
    assert "\n" not in str(info.value)
