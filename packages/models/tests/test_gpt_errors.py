"""Bad GPT layouts fail at construction (or at the first call's shape check) in one sentence."""

from __future__ import annotations

import pytest
import torch

from mega_models import GPTModel, model_config, stage_spec, zigzag_positions
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool


def _message(kind: str) -> str:
    groups = init_process_groups(ParallelConfig(tp=2))
    tiny = model_config("tiny")
    try:
        if kind == "heads":
            GPTModel(
                tiny.replace(num_attention_heads=3, num_query_groups=1, hidden_size=96), groups
            )
        elif kind == "kv_heads":
            GPTModel(tiny.replace(num_query_groups=1), groups)
        elif kind == "sp_seq":
            model = GPTModel(tiny, groups, sequence_parallel=True)
            model(torch.zeros(2, 7, dtype=torch.long))
        elif kind == "sp_tp1":
            from mega_parallel_grid.testing import solo_groups

            GPTModel(tiny, solo_groups(), sequence_parallel=True)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("heads", "num_attention_heads (3) is not divisible by tp (2)"),
        ("kv_heads", "num_query_groups (1) is not divisible by tp (2)"),
        ("sp_seq", "sequence length (7) is not divisible by tp (2)"),
        ("sp_tp1", "sequence_parallel=True needs tp > 1"),
    ],
)
def test_bad_layout_is_one_sentence(dist_pool: DistPool, kind: str, expected: str) -> None:
    messages = dist_pool.run(_message, 2, args=(kind,))
    for message in messages:
        assert expected in message and "\n" not in message


def test_layers_and_sequence_arithmetic() -> None:
    with pytest.raises(
        ValueError, match=r"num_layers \(8\) is not divisible into pp\*vpp \(3\*1 = 3\) stages"
    ) as info:
        stage_spec(8, pp=3, pp_rank=0)
    assert "\n" not in str(info.value)
    with pytest.raises(
        ValueError, match=r"num_layers \(8\) is not divisible into pp\*vpp \(2\*3 = 6\)"
    ):
        stage_spec(8, pp=2, pp_rank=0, vpp=3)
    with pytest.raises(ValueError, match=r"sequence length \(12\) is not divisible by 2\*cp \(8\)"):
        zigzag_positions(12, 4, 0)
    assert stage_spec(8, pp=2, pp_rank=1, vpp=2, chunk=1).layers == (6, 7)
    assert stage_spec(8, pp=2, pp_rank=0, split=[3, 5]).layers == (0, 1, 2)
