"""HF bridge, Nemotron-H: a tiny random ``NemotronHForCausalLM`` built with ``transformers`` (no
download) imported at tp 1, tp 2 and pp 2 gives transformers' logits; exported back it gives
the same tensors bit for bit and, read by transformers, the same config; bad input fails in
one sentence.

``transformers`` is imported only in the pytest process (inside the fixtures).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _hf_common import forward_stages, one_sentence, randomise, read_all, save
from _tolerance import forward_reduction_length

from mega_models.hf import (
    gather_full_state,
    gpt_config_from_hf,
    load_hf_weights,
    save_hf_checkpoint,
)
from mega_models.hf.nemotron_h import (
    load_nemotron_h_weights,
    nemotron_h_config,
    save_nemotron_h_checkpoint,
)
from mega_models.hf.nemotron_h_config import hf_config_from_nemotron_h, nemotron_h_config_from_hf
from mega_models.hybrid import HybridModel
from mega_models.hybrid_sizes import hybrid_config
from mega_models.stages import stage_spec
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device, solo_groups

BATCH, SEQ = 2, 12
SHARD_BYTES = 40_000
BLOCKS = ["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"]
# 6 Mamba heads of 16 in 2 groups: an inner width (96) other than expand * hidden (128);
# chunks of 5 do not divide the sequence; heads of 24, not 64 / 4 (kv_channels)
NEMOTRON_H: dict[str, Any] = {
    "vocab_size": 257, "hidden_size": 64, "layers_block_type": BLOCKS,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "intermediate_size": 128, "ssm_state_size": 8, "mamba_num_heads": 6, "mamba_head_dim": 16,
    "n_groups": 2, "chunk_size": 5, "layer_norm_epsilon": 1e-6, "time_step_min": 0.01,
    "bos_token_id": 5, "eos_token_id": 6, "pad_token_id": 7, "max_position_embeddings": 512,
}  # fmt: skip


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """The saved directory, token ids [b, s] and transformers' logits [b, s, V]."""
    import transformers

    config = transformers.NemotronHConfig(**NEMOTRON_H)
    torch.manual_seed(0)
    model = randomise(transformers.NemotronHForCausalLM(config).eval())
    with torch.no_grad():  # dt = softplus(dt_bias + ...) must reach below time_step_min
        for layer in (0, 4):
            model.model.layers[layer].mixer.dt_bias.sub_(4.0)
    path = tmp_path_factory.mktemp("nemotron_h")
    save(model, path, SHARD_BYTES)
    ids = torch.randint(0, 257, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return path, ids, logits


def _import_export(
    hf_dir: str, out_dir: str, tp: int, pp: int, ids: torch.Tensor, ref: torch.Tensor
) -> None:
    groups = init_process_groups(ParallelConfig(tp=tp, pp=pp))
    config = nemotron_h_config(hf_dir)
    stage = stage_spec(config.num_layers, pp, groups.rank("pp"))
    model = HybridModel(config, groups, stage=stage, seed=5, device=rank_device()).eval()
    # at tp 2 through the common entry points, which dispatch to the Nemotron-H bridge
    (load_hf_weights if tp == 2 else load_nemotron_h_weights)(model, hf_dir)
    logits = forward_stages(model, groups, ids)  # type: ignore[arg-type]
    if logits is not None:
        # fp32 on both sides, same formulas: only the order of float sums differs (tp
        # splits the out_proj, o_proj and down_proj reductions; the scans chunk alike)
        n = forward_reduction_length(config, seq=SEQ)
        assert_close_to_reference(logits, ref, reduction_length=n, name=f"logits tp {tp} pp {pp}")
    state = gather_full_state([model], groups.pp)  # type: ignore[list-item]
    if dist.get_rank() == 0:
        assert state is not None
        save = save_hf_checkpoint if tp == 2 else save_nemotron_h_checkpoint
        save(state, out_dir, config=config, base_config=hf_dir, max_shard_size=SHARD_BYTES)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)], ids=str)
def test_nemotron_h_import_matches_transformers_and_export_is_identical(
    dist_pool: DistPool,
    nemotron: tuple[Path, torch.Tensor, torch.Tensor],
    tmp_path: Path,
    tp: int,
    pp: int,
) -> None:
    import transformers

    hf_dir, ids, ref = nemotron
    out = tmp_path / "export"
    dist_pool.run(_import_export, tp * pp, args=(str(hf_dir), str(out), tp, pp, ids, ref))
    original, exported = read_all(hf_dir), read_all(out)
    assert "backbone.layers.0.mixer.in_proj.weight" in exported
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert len(list(out.glob("*.safetensors"))) > 1  # sharded, with an index
    # transformers reads the export as the model it wrote: the whole config, the logits
    theirs, mine = (transformers.AutoConfig.from_pretrained(p).to_dict() for p in (hf_dir, out))
    assert {**mine, "_name_or_path": ""} == {**theirs, "_name_or_path": ""}  # all but the path
    assert (mine["bos_token_id"], mine["eos_token_id"], mine["pad_token_id"]) == (5, 6, 7)
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "NemotronHForCausalLM"
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, ref)


def test_nemotron_h_config_both_ways(nemotron: tuple[Path, torch.Tensor, torch.Tensor]) -> None:
    import transformers

    config = nemotron_h_config(nemotron[0])
    assert gpt_config_from_hf(nemotron[0]) == config  # the common entry point dispatches
    assert (config.pattern, config.activation, config.position) == ("M-*-M-", "relu2", "none")
    assert (config.mamba_inner, config.mamba_num_heads, config.mamba_inner_size) == (96, 6, 96)
    assert config.mamba_dt_limit == (0.01, math.inf) and config.mamba_dt_min == 0.01
    assert (config.norm_eps, config.kv_heads, config.mamba_chunk_size) == (1e-6, 2, 5)
    assert not config.tie_embeddings and (config.kv_channels, config.head_dim) == (24, 24)
    for size in ("nemotron-h-tiny", "nemotron-h-1b"):
        mine = hybrid_config(size)
        written = hf_config_from_nemotron_h(mine)
        assert written["architectures"] == ["NemotronHForCausalLM"]
        assert nemotron_h_config_from_hf(written) == mine
        hf = transformers.NemotronHConfig(**{k: v for k, v in written.items()
                                             if k != "architectures"})  # fmt: skip
        assert hf.hybrid_override_pattern == mine.pattern
        assert hf.mamba_num_heads * hf.mamba_head_dim == mine.mamba_inner


def test_nemotron_h_older_spellings_are_read_and_kept(
    nemotron: tuple[Path, torch.Tensor, torch.Tensor], tmp_path: Path
) -> None:
    """A 4.x-era config.json (hybrid_override_pattern, num_hidden_layers, mamba_* aliases)
    reads as transformers reads it and exports in the same spelling."""
    import transformers

    base = json.loads((nemotron[0] / "config.json").read_text())
    old = {k: v for k, v in base.items() if k not in ("layers_block_type", "n_groups")}
    old.update({"hybrid_override_pattern": "M-*-M-", "num_hidden_layers": 6,
                "mamba_n_groups": 2, "attention_head_dim": 24})  # fmt: skip
    config = nemotron_h_config_from_hf(old)
    assert config == nemotron_h_config(nemotron[0])
    written = hf_config_from_nemotron_h(config, base=old)
    assert "layers_block_type" not in written and written["hybrid_override_pattern"] == "M-*-M-"
    assert written["num_hidden_layers"] == 6 and written["mamba_n_groups"] == 2
    (tmp_path / "config.json").write_text(json.dumps(written))
    hf: Any = transformers.AutoConfig.from_pretrained(tmp_path)
    assert (hf.layers_block_type, hf.n_groups) == (BLOCKS, 2)


def _mismatch(hf_dir: str) -> str:
    model = HybridModel(hybrid_config("nemotron-h-tiny"), solo_groups(), seed=1)
    with pytest.raises(ValueError) as err:
        load_nemotron_h_weights(model, hf_dir)
    return str(err.value)


def test_nemotron_h_bad_input_fails_in_one_sentence(
    dist_pool: DistPool, nemotron: tuple[Path, torch.Tensor, torch.Tensor]
) -> None:
    base = json.loads((nemotron[0] / "config.json").read_text())
    cases = [
        ({"layers_block_type": ["linear_attention", "moe"]}, ("MoE blocks", "'moe' at layer 1")),
        ({"layers_block_type": ["mamba"]}, ("layers_block_type (['mamba'])", "'mlp'")),
        ({"mlp_hidden_act": "silu"}, ("mlp_hidden_act ('silu')", "'relu2'")),
        ({"mamba_hidden_act": "gelu"}, ("mamba_hidden_act ('gelu')", "'silu'")),
        ({"use_bias": True}, ("use_bias (True)", "false")),
        ({"mlp_bias": True}, ("mlp_bias (True)", "false")),
        ({"num_nextn_predict_layers": 1}, ("num_nextn_predict_layers (1)", "(0)")),
        ({"sliding_window": 64}, ("sliding_window (64)", "null")),
        ({"n_groups": 4}, ("Mamba heads (6)", "mamba_num_groups (4)")),
        ({"architectures": ["LlamaForCausalLM"]}, ("LlamaForCausalLM", "NemotronHForCausalLM")),
    ]
    for change, words in cases:
        with pytest.raises(ValueError) as err:
            nemotron_h_config_from_hf({**base, **change})
        one_sentence(err, *words)
    tiny = hybrid_config("nemotron-h-tiny")
    for change, words in (
        ({"activation": "swiglu"}, ("activation ('swiglu')", "NemotronHForCausalLM")),
        ({"position": "rope"}, ("position ('rope')", "position='none'")),
        ({"mamba_dt_limit": (0.0, math.inf)}, ("mamba_dt_limit (0.0, inf)", "(mamba_dt_min, inf)")),
    ):
        with pytest.raises(ValueError) as err:
            hf_config_from_nemotron_h(tiny.replace(**change))
        one_sentence(err, *words)
    with pytest.raises(ValueError) as err:
        check = hybrid_config("nemotron-h-tiny")
        save_nemotron_h_checkpoint({}, nemotron[0] / "x", config=check, base_config=nemotron[0])
    one_sentence(err, "pattern 'M-*-M-'", "'M-M*-M*-'", "imported from")
    [message] = dist_pool.run(_mismatch, 1, args=(str(nemotron[0]),))
    assert "\n" not in message and "pattern ('M-M*-M*-')" in message, message
    assert "nemotron_h_config(" in message, message


def _convert(*args: str, cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "mega_pretrain", "convert", *args]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.skipif(
    importlib.util.find_spec("mega_pretrain") is None, reason="needs the mega-pretrain app"
)
def test_nemotron_h_converts_through_the_command_line(
    nemotron: tuple[Path, torch.Tensor, torch.Tensor], tmp_path: Path
) -> None:
    """``convert --from-hf`` then ``--to-hf`` (the hybrid family's adapter, its (low, high)
    ranges through model.toml): the same tensors and config.json."""
    hf_dir = nemotron[0]
    _convert("--from-hf", str(hf_dir), "--to", str(tmp_path / "run"), cwd=tmp_path)
    assert "mamba_dt_limit = [0.01, inf]" in (tmp_path / "run" / "model.toml").read_text()
    _convert("--to-hf", str(tmp_path / "back"), "--from", str(tmp_path / "run"), cwd=tmp_path)
    original, exported = read_all(hf_dir), read_all(tmp_path / "back")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[name], t) for name, t in original.items())
    mine, theirs = (
        json.loads((p / "config.json").read_text()) for p in (tmp_path / "back", hf_dir)
    )
    assert mine == theirs
