"""The trainer's packing switches: tiny trains from the CLI with all three on, and every
combination it cannot honour is refused at config time in one sentence."""

from __future__ import annotations

from pathlib import Path

import pytest
from _cli_training import assert_loss_falls, train_from_cli

from mega_pretrain.build import gpt_config
from mega_pretrain.config import load_config
from mega_pretrain.data.packing import packing_for
from mega_pretrain.plan import plan_for
from mega_pretrain.validate import check_config

ROOT = Path(__file__).resolve().parents[3]
ON = [("data.reset_position_ids", "true"), ("data.reset_attention_mask", "true"),
      ("data.eod_mask_loss", "true")]  # fmt: skip


def test_tiny_trains_with_packing_from_the_cli(tmp_path: Path) -> None:
    flags = [f"--{name}={value}" for name, value in ON]
    losses = train_from_cli(tmp_path, ROOT / "configs" / "tiny.toml", "packed", "--run.name",
                            "packed", *flags)  # fmt: skip
    assert_loss_falls(losses)


def test_packing_comes_from_the_tokenizer() -> None:
    assert packing_for(load_config(None, [])) is None
    packing = packing_for(load_config(None, [("data.eod_mask_loss", "true")]))
    assert packing is not None and packing.eod_id == 256 and packing.eod_mask_loss
    assert not packing.needs_documents


def _check(overrides: list[tuple[str, str]], world: int = 1) -> None:
    config = load_config(None, overrides)
    check_config(config, plan_for(config, world).model, world)


def test_supported_combinations_pass() -> None:
    _check(ON)
    _check([*ON, ("parallel.cp", "2"), ("parallel.cp_method", "all_gather")], world=2)
    _check([("model.size", "hybrid-tiny"), ("data.eod_mask_loss", "true")])
    _check([("model.position", "learned"), ("data.reset_attention_mask", "true")])
    assert gpt_config(load_config(None, ON)).position == "rope"


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (
            [("model.size", "hybrid-tiny"), ("data.reset_attention_mask", "true")],
            1,
            r"not supported for hybrid models: their Mamba layers",
        ),
        (
            [("model.size", "hybrid-tiny"), ("data.reset_position_ids", "true")],
            1,
            r"not supported for hybrid models",
        ),
        (
            [("model.mtp_num_layers", "1"), ("data.eod_mask_loss", "true")],
            1,
            r"data.eod_mask_loss cannot be combined with multi-token prediction",
        ),
        (
            [("model.position", "learned"), ("data.reset_position_ids", "true")],
            1,
            r"needs model.position 'rope' or 'none', not 'learned'",
        ),
        (
            [("model.attention_dropout", "0.1"), ("data.reset_attention_mask", "true")],
            1,
            r"does not support attention_dropout \(0.1\)",
        ),
        (
            [("parallel.cp", "2"), ("data.reset_attention_mask", "true")],
            2,
            r"needs parallel.cp_method all_gather, not 'ring'",
        ),
    ],
    ids=["hybrid-mask", "hybrid-positions", "mtp", "learned", "attention-dropout", "cp-ring"],
)
def test_unsupported_combinations_refuse(
    overrides: list[tuple[str, str]], world: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _check(overrides, world)
