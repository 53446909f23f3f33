"""HF bridge, Qwen3-MoE: a tiny random ``Qwen3MoeForCausalLM`` built with ``transformers`` (no
download) imported at tp 1, tp 2 and ep 2 gives transformers' logits (q/k norms, softmax
top-k routing with ``norm_topk_prob``, a dense ``mlp_only_layers`` layer); exported back it
gives the same tensors and config.json, which transformers reads as the same model; the
registered ``qwen3-moe-tiny`` trains from the command line. Qwen3 and Qwen3-MoE with an
explicit ``head_dim`` other than hidden / heads (Qwen3-0.6B's 16 heads of 128 on 1024) import
as ``kv_channels`` and give transformers' logits at tp 1 and 2.

``transformers`` is imported only in the pytest process (inside fixtures and tests).
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
from _hf_export_check import assert_export_identical

from mega_models import GPTModel, model_config
from mega_models.hf import (
    default_architecture,
    gather_full_state,
    gpt_config_from_hf,
    hf_config_from_gpt,
    hf_layout,
    load_hf_weights,
    save_hf_checkpoint,
)
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device

BATCH, SEQ = 2, 12
SHARD_BYTES = 40_000  # several shards, experts spread over them
ROOT = Path(__file__).resolve().parents[3]
QWEN3_MOE: dict[str, Any] = {
    "vocab_size": 101, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "intermediate_size": 48, "num_hidden_layers": 3, "rms_norm_eps": 1e-6,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1],
    "max_position_embeddings": 64, "bos_token_id": 5, "eos_token_id": 7, "pad_token_id": 0,
}  # fmt: skip
ROPE_THETA = 1e6


def _transformers_config(family: str = "Qwen3Moe", **changes: Any) -> Any:
    import transformers

    config = getattr(transformers, f"{family}Config")(**{**QWEN3_MOE, **changes})
    config.rope_parameters["rope_theta"] = ROPE_THETA
    return config


Checkpoint = tuple[Path, torch.Tensor, torch.Tensor]


def _checkpoint(path: Path, family: str = "Qwen3Moe", **changes: Any) -> Checkpoint:
    """The saved directory, token ids [b, s] and transformers' logits [b, s, V]."""
    import transformers

    torch.manual_seed(0)
    config = _transformers_config(family, **changes)
    model = randomise(getattr(transformers, f"{family}ForCausalLM")(config).eval())
    save(model, path, SHARD_BYTES)
    assert (path / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 101, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    ids[0, -1] = 100  # the last real row of the (padded) vocabulary
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return path, ids, logits


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return _checkpoint(tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    """Qwen3 and Qwen3-MoE with 4 heads of 16 on a hidden size of 32 (not 32 / 4 = 8)."""
    return {
        family: _checkpoint(tmp_path_factory.mktemp(family), family, head_dim=16)
        for family in ("Qwen3", "Qwen3Moe")
    }


def _import_export(
    hf_dir: str, out_dir: str, tp: int, ep: int, ids: torch.Tensor, ref: torch.Tensor
) -> None:
    groups = init_process_groups(ParallelConfig(tp=tp, ep=ep))
    config = gpt_config_from_hf(hf_dir)
    model = GPTModel(config, groups, seed=5, device=rank_device()).eval()
    load_hf_weights(model, hf_dir)
    logits = forward_stages(model, groups, ids)  # every rank runs the same ids
    assert logits is not None
    # fp32 on both sides, same formulas: only the order of float sums differs (tp splits the
    # o_proj and down_proj reductions, a token's k expert outputs are added in another
    # order, grouped GEMMs and SDPA block differently); the router sees inputs equal up to
    # that rounding and picks the same experts (another pick moves a logit by O(1)). The
    # longest chain behind a logit: per layer the norms, projections, attention over the
    # sequence, the dense or expert FFN width and the k-way combine, then the final norm
    # and the head.
    h, c = config.hidden_size, config
    per_layer = 2 * h + 2 * c.num_attention_heads * c.head_dim + SEQ
    per_layer += max(c.ffn_size, c.moe_ffn_size) + c.moe_top_k
    n = c.num_layers * per_layer + h + c.vocab_size
    assert_close_to_reference(logits, ref, reduction_length=n, name=f"logits at tp {tp} ep {ep}")
    state = gather_full_state(model)  # collective over tp and ep
    if dist.get_rank() == 0:
        assert state is not None
        save_hf_checkpoint(state, out_dir, config=config, base_config=hf_dir,
                           max_shard_size=SHARD_BYTES)  # fmt: skip


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "ep2"])
def test_qwen3_moe_import_matches_transformers_and_export_is_identical(
    dist_pool: DistPool,
    qwen3_moe: Checkpoint,
    tmp_path: Path,
    tp: int,
    ep: int,
) -> None:

    hf_dir, ids, ref = qwen3_moe
    out = tmp_path / "export"
    dist_pool.run(_import_export, tp * ep, args=(str(hf_dir), str(out), tp, ep, ids, ref))
    exported = assert_export_identical(hf_dir, out, "Qwen3MoeForCausalLM", ids, ref)
    assert "model.layers.2.mlp.experts.7.up_proj.weight" in exported
    assert "model.layers.1.mlp.down_proj.weight" in exported  # the mlp_only layer


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["Qwen3", "Qwen3Moe"])
def test_explicit_head_dim_matches_transformers_and_exports(
    dist_pool: DistPool, wide_heads: dict[str, Checkpoint], tmp_path: Path, family: str, tp: int
) -> None:
    hf_dir, ids, ref = wide_heads[family]
    config = gpt_config_from_hf(hf_dir)
    assert (config.kv_channels, config.head_dim, config.is_moe) == (16, 16, family == "Qwen3Moe")
    out = tmp_path / "export"
    dist_pool.run(_import_export, tp, args=(str(hf_dir), str(out), tp, 1, ids, ref))
    original, exported = read_all(hf_dir), read_all(out)
    assert original["model.layers.0.self_attn.q_proj.weight"].shape == (64, 32)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    written = json.loads((out / "config.json").read_text())
    assert written["head_dim"] == 16 and gpt_config_from_hf(written) == config
    with pytest.raises(ValueError) as err:  # Llama derives the head dim from hidden / heads
        hf_config_from_gpt(config.replace(qk_norm=False), "MixtralForCausalLM" if config.is_moe
                           else "LlamaForCausalLM")  # fmt: skip
    one_sentence(err, "kv_channels (16)", "hidden_size / num_attention_heads (8)")


def test_qwen3_moe_config_both_ways(qwen3_moe: Checkpoint) -> None:
    config = gpt_config_from_hf(qwen3_moe[0])
    assert config.qk_norm and not (config.add_bias or config.qkv_bias or config.tie_embeddings)
    assert (config.num_experts, config.moe_top_k, config.moe_ffn_size) == (8, 2, 16)
    assert (config.moe_layer_pattern, config.moe_shared_expert_size) == ("E-E", 0)
    assert config.moe_softmax_before_topk and config.moe_normalize_topk
    assert hf_layout(qwen3_moe[0]).num_experts == 8
    mine = model_config("qwen3-moe-tiny")
    assert default_architecture(mine) == "Qwen3MoeForCausalLM"
    written = hf_config_from_gpt(mine)
    assert (written["decoder_sparse_step"], written["mlp_only_layers"]) == (1, [0])
    assert written["norm_topk_prob"] is True
    assert gpt_config_from_hf(written) == mine.replace(moe_aux_loss_coeff=0.0)  # not mapped
    unnormalised = mine.replace(moe_normalize_topk=False)
    assert hf_config_from_gpt(unnormalised)["norm_topk_prob"] is False
    assert gpt_config_from_hf(hf_config_from_gpt(unnormalised)) == unnormalised.replace(
        moe_aux_loss_coeff=0.0
    )


@pytest.mark.parametrize(
    ("step", "mlp_only"), [(1, []), (2, []), (2, [3]), (3, [0]), (1, [0, 2])], ids=str
)
def test_sparse_layers_are_where_transformers_builds_them(step: int, mlp_only: list[int]) -> None:
    """``decoder_sparse_step`` / ``mlp_only_layers`` -> ``moe_layer_pattern`` -> back again."""
    import transformers

    hf = _transformers_config(num_hidden_layers=4, decoder_sparse_step=step,
                              mlp_only_layers=mlp_only)  # fmt: skip
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(hf)
    sparse = "".join(
        "E" if type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" else "-"
        for layer in model.model.layers
    )
    raw = {**hf.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}
    config = gpt_config_from_hf(raw)
    assert config.moe_layer_pattern == (None if "-" not in sparse else sparse)
    written = hf_config_from_gpt(config, base=raw)
    assert (written["decoder_sparse_step"], written["mlp_only_layers"]) == (step, mlp_only)
    fresh = hf_config_from_gpt(config)  # no base: the largest step that fits
    assert gpt_config_from_hf(fresh).moe_layers == config.moe_layers


def test_qwen3_moe_bad_input_fails_in_one_sentence(
    qwen3_moe: Checkpoint,
) -> None:
    base = json.loads((qwen3_moe[0] / "config.json").read_text())
    cases: list[tuple[dict[str, Any], tuple[str, ...]]] = [
        ({"attention_bias": True}, ("attention_bias (True)", "Qwen3MoeForCausalLM", "false")),
        ({"num_local_experts": 0}, ("num_experts (0)", "Qwen3ForCausalLM")),
        ({"decoder_sparse_step": 0}, ("decoder_sparse_step (0)", "Qwen3MoeForCausalLM")),
        ({"mlp_only_layers": [0, 1, 2]}, ("no sparse layer", "mlp_only_layers ([0, 1, 2])")),
        ({"hidden_act": "gelu"}, ("hidden_act ('gelu')", "silu")),
    ]
    for change, words in cases:
        with pytest.raises(ValueError) as err:
            gpt_config_from_hf({**base, **change})
        one_sentence(err, *words)
    tiny = model_config("qwen3-moe-tiny")
    exports: list[tuple[Any, str | None, tuple[str, ...]]] = [
        (tiny.replace(moe_shared_expert_size=32), None,
         ("no shared expert", "moe_shared_expert_size to 0")),
        (tiny.replace(moe_score_function="sigmoid"), None, ("moe_score_function ('sigmoid')",)),
        (tiny.replace(moe_layer_pattern=None), "MixtralForCausalLM",
         ("qk_norm (True)", "MixtralForCausalLM", "Qwen3MoeForCausalLM")),
        (tiny.replace(qk_norm=False), "Qwen3MoeForCausalLM",
         ("qk_norm (False)", "Qwen3MoeForCausalLM")),
        (tiny.replace(qkv_bias=True), None, ("qkv_bias (True)", "Qwen3MoeForCausalLM")),
        (model_config("qwen3-tiny"), "Qwen3MoeForCausalLM", ("dense", "num_experts 0")),
    ]  # fmt: skip
    for config, arch, words in exports:
        with pytest.raises(ValueError) as err:
            hf_config_from_gpt(config, arch)
        one_sentence(err, *words)


@pytest.mark.skipif(
    importlib.util.find_spec("mega_pretrain") is None, reason="needs the mega-pretrain app"
)
def test_qwen3_moe_tiny_trains_from_the_command_line(tmp_path: Path) -> None:
    losses = train_from_cli(ROOT / "configs/qwen3-moe-tiny.toml", tmp_path, steps=12)
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
