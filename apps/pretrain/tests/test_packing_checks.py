"""A packed sample longer than the model takes, with packing on: one sentence at config time
(``check_config``, so also ``--dry-run`` and the start of a run), naming the values and the
way out. The trainer's samples are windows of ``train.seq_len`` tokens whatever their
documents, so that is where a packed sample can exceed what the model takes."""

from __future__ import annotations

import pytest

from mega_pretrain.cli import main
from mega_pretrain.config import load_config
from mega_pretrain.plan import plan_for
from mega_pretrain.validate import check_config

MAX = 256  # the tiny model's max_seq_len


def _check(*overrides: tuple[str, str]) -> None:
    config = load_config(None, list(overrides))
    model = plan_for(config, 1).model
    check_config(config, model, 1)


@pytest.mark.parametrize(
    "switch", ["data.reset_attention_mask", "data.reset_position_ids", "data.eod_mask_loss"]
)
def test_a_packed_sample_longer_than_max_seq_len_is_one_sentence(switch: str) -> None:
    assert plan_for(load_config(None, []), 1).model.max_seq_len == MAX
    with pytest.raises(ValueError) as info:
        _check(("train.seq_len", "512"), (switch, "true"))
    said = str(info.value)
    assert said == (
        f"a packed sample is train.seq_len (512) tokens whatever {switch} does inside it "
        "(positions and the mask restart per document; the window stays one sequence), longer "
        f"than the model's max_seq_len ({MAX}); set train.seq_len to at most {MAX} or raise "
        "model.max_seq_len"
    )


def test_every_switch_that_is_on_is_named() -> None:
    with pytest.raises(ValueError, match=r"whatever data.reset_position_ids, data.reset_att"):
        _check(("train.seq_len", "512"), ("data.reset_position_ids", "true"),
               ("data.reset_attention_mask", "true"))  # fmt: skip


def test_a_packed_sample_that_fits_passes_and_packing_off_keeps_its_sentence() -> None:
    _check(("train.seq_len", str(MAX)), ("data.reset_attention_mask", "true"))
    _check(("train.seq_len", "512"), ("model.max_seq_len", "512"),
           ("data.reset_attention_mask", "true"))  # fmt: skip
    with pytest.raises(ValueError, match=r"train.seq_len \(512\) exceeds the model's max_seq_len"):
        _check(("train.seq_len", "512"))


def test_the_dry_run_says_it_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--dry-run", "--train.seq_len", "512", "--data.reset_attention_mask", "true"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: a packed sample is train.seq_len (512)"), err
    assert err.count("\n") == 1 and "Traceback" not in err
