"""HF bridge, Qwen3 dense: a tiny random ``Qwen3ForCausalLM`` built with ``transformers`` (no
download) imported at tp 1 and 2 gives transformers' logits (q/k norms included); exported
back it gives the same tensors and, read by transformers, the same config; the registered
``qwen3-tiny`` trains from the command line.

``transformers`` is imported only in the pytest process (inside the fixtures).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _hf_cli import train_from_cli
from _hf_common import forward_stages, one_sentence, randomise, read_all, save

from mega_models import GPTModel, model_config
from mega_models.hf import (
    gather_full_state,
    gpt_config_from_hf,
    hf_config_from_gpt,
    load_hf_weights,
    save_hf_checkpoint,
)
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device

BATCH, SEQ = 2, 12
SHARD_BYTES = 40_000
ROOT = Path(__file__).resolve().parents[3]
QWEN3: dict[str, Any] = {
    "vocab_size": 257, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "intermediate_size": 128, "num_hidden_layers": 2, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}  # fmt: skip
ROPE_THETA = 1e6


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """The saved directory, token ids [b, s] and transformers' logits [b, s, V]."""
    import transformers

    config = transformers.Qwen3Config(**QWEN3)
    config.rope_parameters["rope_theta"] = ROPE_THETA
    torch.manual_seed(0)
    model = randomise(transformers.Qwen3ForCausalLM(config).eval())  # q/k norms too
    path = tmp_path_factory.mktemp("qwen3")
    save(model, path, SHARD_BYTES)
    ids = torch.randint(0, 257, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return path, ids, logits


def _import_export(
    hf_dir: str, out_dir: str, tp: int, ids: torch.Tensor, ref: torch.Tensor
) -> None:
    groups = init_process_groups(ParallelConfig(tp=tp))
    config = gpt_config_from_hf(hf_dir)
    model = GPTModel(config, groups, seed=5, device=rank_device()).eval()
    load_hf_weights(model, hf_dir)
    logits = forward_stages(model, groups, ids)
    assert logits is not None
    # fp32 on both sides, same formulas: only the order of float sums differs (tp splits
    # the o_proj and down_proj reductions; kernels block differently). The longest chain
    # behind a logit: per layer the norms, projections, attention over the sequence and the
    # FFN width, then the final norm and the head.
    h = config.hidden_size
    n = config.num_layers * (4 * h + config.ffn_size + SEQ) + h + config.vocab_size
    assert_close_to_reference(logits, ref, reduction_length=n, name=f"logits at tp {tp}")
    state = gather_full_state(model)  # collective over tp
    if dist.get_rank() == 0:
        assert state is not None
        save_hf_checkpoint(state, out_dir, config=config, base_config=hf_dir,
                           max_shard_size=SHARD_BYTES)  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_import_matches_transformers_and_export_is_identical(
    dist_pool: DistPool, qwen3: tuple[Path, torch.Tensor, torch.Tensor], tmp_path: Path, tp: int
) -> None:
    import transformers

    hf_dir, ids, ref = qwen3
    out = tmp_path / "export"
    dist_pool.run(_import_export, tp, args=(str(hf_dir), str(out), tp, ids, ref))
    original, exported = read_all(hf_dir), read_all(out)
    assert "model.layers.1.self_attn.q_norm.weight" in exported
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    # transformers reads the export as the model it wrote: the whole config, the logits
    theirs, mine = (transformers.AutoConfig.from_pretrained(p).to_dict() for p in (hf_dir, out))
    assert {**mine, "_name_or_path": ""} == {**theirs, "_name_or_path": ""}  # all but the path
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, ref)


def test_qwen3_config_both_ways(qwen3: tuple[Path, torch.Tensor, torch.Tensor]) -> None:
    import transformers

    config = gpt_config_from_hf(qwen3[0])
    assert config.qk_norm and config.tie_embeddings and not (config.add_bias or config.qkv_bias)
    assert (config.head_dim, config.kv_heads, config.rope_theta) == (16, 2, ROPE_THETA)
    assert config.norm_eps == 1e-6
    for size in ("qwen3-tiny", "qwen3-1.7b"):
        mine = model_config(size)
        written = hf_config_from_gpt(mine)
        assert written["architectures"] == ["Qwen3ForCausalLM"]
        assert gpt_config_from_hf(written) == mine
        hf = transformers.Qwen3Config(**{k: v for k, v in written.items() if k != "architectures"})
        assert (hf.head_dim, hf.attention_bias, hf.use_sliding_window) == (
            mine.head_dim,
            False,
            False,
        )
    big = hf_config_from_gpt(model_config("qwen3-1.7b"))
    published = {
        "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144,
        "vocab_size": 151936, "tie_word_embeddings": True, "rope_theta": 1e6,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    }  # fmt: skip
    assert {k: big[k] for k in published} == published


def test_qwen3_bad_input_fails_in_one_sentence(
    qwen3: tuple[Path, torch.Tensor, torch.Tensor],
) -> None:
    base = json.loads((qwen3[0] / "config.json").read_text())
    with pytest.raises(ValueError) as err:
        gpt_config_from_hf({**base, "attention_bias": True})
    one_sentence(err, "attention_bias (True)", "Qwen3ForCausalLM", "false")
    # Qwen3-0.6B/4B-style head_dim * heads != hidden: an explicit head width (test_hf_qwen3_moe tests it)
    assert gpt_config_from_hf({**base, "head_dim": 32}).kv_channels == 32
    tiny = model_config("qwen3-tiny")
    with pytest.raises(ValueError) as err:
        hf_config_from_gpt(tiny, "LlamaForCausalLM")
    one_sentence(err, "qk_norm (True)", "LlamaForCausalLM", "Qwen3ForCausalLM")
    with pytest.raises(ValueError) as err:
        hf_config_from_gpt(tiny.replace(qk_norm=False), "Qwen3ForCausalLM")
    one_sentence(err, "qk_norm (False)", "Qwen3ForCausalLM")
    with pytest.raises(ValueError) as err:
        hf_config_from_gpt(tiny.replace(qkv_bias=True))
    one_sentence(err, "qkv_bias (True)", "Qwen3ForCausalLM")


@pytest.mark.skipif(
    importlib.util.find_spec("mega_pretrain") is None, reason="needs the mega-pretrain app"
)
def test_qwen3_tiny_trains_from_the_command_line(tmp_path: Path) -> None:
    losses = train_from_cli(ROOT / "configs/qwen3-tiny.toml", tmp_path, steps=12)
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
