"""HF bridge, DeepSeek-V3: a tiny random ``DeepseekV3ForCausalLM`` built with ``transformers``
(no download), with one MTP depth stored as DeepSeek stores it (``model.layers.{L}``:
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``, ``embed_tokens`` and a decoder layer),
imported at tp 1, tp 2, ep 2 and pp 2 (MTP on the last stage): the logits equal transformers' (latent attention with
interleaved rope rows, sigmoid routing with the correction bias, group-limited choice
where a group scores its best 2, ``routed_scaling_factor``, a dense first layer, the
shared expert), and the MTP loss equals one computed with transformers' own decoder layer
and norms (one stage); exported back, the same tensors (MTP included) and config.json.

``transformers`` is imported only in the pytest process (inside fixtures and tests).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _hf_common import forward_stages, one_sentence, randomise, read_all, save
from _hf_export_check import assert_export_identical
from torch import nn

from mega_models import GPTConfig, GPTModel, model_config, stage_spec
from mega_models.hf import (
    default_architecture,
    gather_full_state,
    gpt_config_from_hf,
    gpt_parameter_names,
    hf_config_from_gpt,
    hf_layout,
    load_hf_weights,
    save_hf_checkpoint,
)
from mega_models.hf.mapping import deinterleave_rope, interleave_rope
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device

BATCH, SEQ = 2, 12
SHARD_BYTES = 40_000
LAYERS = 3
DEEPSEEK: dict[str, Any] = {
    "vocab_size": 101, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": LAYERS,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 8,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6, "first_k_dense_replace": 1,
    # 16 experts in 4 groups of 4, top 3 inside the best 2 groups: a group scores its best 2
    # (Megatron's top_k // topk_group would be 1, so this case tells the two rules apart)
    "n_routed_experts": 16, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
    "moe_intermediate_size": 16, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "num_nextn_predict_layers": 1, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6, "bos_token_id": 3, "eos_token_id": 4, "pad_token_id": 0,
}  # fmt: skip
ROPE_THETA = 5e4
# DeepSeek's YaRN: 4x the 16 positions it was trained at, the softmax scale corrected too
YARN: dict[str, Any] = {
    "rope_type": "yarn", "rope_theta": ROPE_THETA, "factor": 4.0,
    "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
    "mscale": 1.0, "mscale_all_dim": 1.0,
}  # fmt: skip


def _hf_config(**changes: Any) -> Any:
    import transformers

    config = transformers.DeepseekV3Config(**{**DEEPSEEK, **changes})
    config.rope_parameters["rope_theta"] = ROPE_THETA
    return config


class _MTPDepth(nn.Module):
    """DeepSeek-V3's MTP module as transformers' pieces: its tensors carry DeepSeek's names."""

    def __init__(self, config: Any) -> None:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = ds.DeepseekV3RMSNorm(h, eps), ds.DeepseekV3RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = ds.DeepseekV3DecoderLayer(config, config.num_hidden_layers)  # MoE kind
        self.norm = ds.DeepseekV3RMSNorm(h, eps)  # DeepSeek's shared_head.norm

    def tensors(self, model: Any, prefix: str) -> dict[str, torch.Tensor]:
        own = {"norm.weight": "shared_head.norm.weight"}
        out = {}
        for name, tensor in self.state_dict().items():
            name = prefix + own.get(name, name.removeprefix("layer."))
            if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2f, h]: per expert, as saved
                for e, (gate, up) in enumerate(t.chunk(2) for t in tensor):
                    out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate.clone()
                    out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up.clone()
            elif name.endswith("mlp.experts.down_proj"):  # [E, h, f]
                for e, down in enumerate(tensor):
                    out[name.replace("down_proj", f"{e}.down_proj.weight")] = down.clone()
            else:
                out[name] = tensor.clone()
        out[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
        out[prefix + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
        return out

    def loss(self, model: Any, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Depth 1's mean cross entropy: position t sees h0_t and token t + 1, predicts t + 2."""
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        x = self.eh_proj(torch.cat([self.enorm(model.model.embed_tokens(labels)),
                                    self.hnorm(hidden)], dim=-1))  # fmt: skip
        s = x.shape[1]
        positions = torch.arange(s)[None].expand(ids.shape[0], -1)
        rope = model.model.rotary_emb(x, positions)
        causal = torch.full((s, s), torch.finfo(x.dtype).min).triu(1)[None, None]
        x = self.layer(x, attention_mask=causal, position_ids=positions, position_embeddings=rope)
        logits = model.lm_head(self.norm(x))[:, :-1]  # the last position has no target
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def _randomise_biases(module: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for sub in module.modules():
        bias = getattr(sub, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(0.1 * torch.randn(bias.shape, generator=gen))


def _add_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One more shard file in a saved checkpoint, listed in its index (as DeepSeek ships MTP)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"].update(dict.fromkeys(tensors, "model-mtp.safetensors"))
    index_file.write_text(json.dumps(index, indent=2))


Checkpoint = tuple[Path, torch.Tensor, torch.Tensor, torch.Tensor]


def _checkpoint(path: Path, **changes: Any) -> Checkpoint:
    """The saved directory (MTP depth included), tokens [b, s + 1], transformers' logits of
    ``tokens[:, :-1]`` and the MTP depth's loss."""
    import transformers

    config = _hf_config(**changes)
    torch.manual_seed(0)
    model = randomise(transformers.DeepseekV3ForCausalLM(config).eval())
    mtp = randomise(_MTPDepth(config).eval())
    with torch.no_grad():
        _randomise_biases(model, 1)
        _randomise_biases(mtp, 2)
    save(model, path, SHARD_BYTES)
    _add_tensors(path, mtp.tensors(model, f"model.layers.{LAYERS}."))
    tokens = torch.randint(0, 101, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(2))
    tokens[0, -2] = 100  # the last real row of the (padded) vocabulary
    captured: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_pre_hook(lambda _, args: captured.append(args[0]))
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits.float()
        hook.remove()
        mtp_loss = mtp.loss(model, captured[0], tokens)
    return path, tokens, logits, mtp_loss


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return _checkpoint(tmp_path_factory.mktemp("deepseek_v3"))


@pytest.fixture(scope="module")
def deepseek_yarn(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return _checkpoint(tmp_path_factory.mktemp("deepseek_v3_yarn"), rope_parameters=YARN)


def _chain(config: GPTConfig) -> int:
    """The longest chain of float sums behind a logit: per layer the norms, the latent and
    head projections, attention over the sequence, the widest FFN and the k-way combine,
    then the final norm and the head (and, for the MTP loss, one layer and eh_proj more)."""
    c, h = config, config.hidden_size
    assert c.kv_lora_rank
    ffn = max(c.ffn_size, c.moe_ffn_size + c.moe_shared_expert_size)
    per_layer = 4 * h + (c.q_lora_rank or 0) + c.kv_lora_rank + SEQ + ffn + c.moe_top_k
    return (c.num_layers + 1) * per_layer + 3 * h + c.vocab_size


def _import_export(
    hf_dir: str, out_dir: str, layout: tuple[int, int, int], ref: Checkpoint
) -> None:
    _, tokens, logits_ref, mtp_ref = ref
    tp, pp, ep = layout
    groups = init_process_groups(ParallelConfig(tp=tp, pp=pp, ep=ep))
    config = gpt_config_from_hf(hf_dir)
    split = (2, 1) if pp == 2 else None  # the dense layer and one MoE layer, then MoE + MTP
    stage = stage_spec(config.num_layers, pp, groups.rank("pp"), split=split)
    model = GPTModel(config, groups, stage=stage, seed=5, device=rank_device()).eval()
    load_hf_weights(model, hf_dir)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    logits = forward_stages(model, groups, ids)  # the main logits (no labels: no MTP)
    n, where = _chain(config), f"tp {tp} pp {pp} ep {ep}"
    if logits is not None:
        assert_close_to_reference(logits, logits_ref, reduction_length=n, name=f"logits, {where}")
    if pp == 1:  # the MTP loss of one stage (forward_stages passes no labels along)
        with torch.no_grad():
            model(ids.to(rank_device()), labels.to(rank_device()))
        assert model.mtp_losses is not None
        mtp = model.mtp_losses.cpu()
        assert_close_to_reference(mtp, mtp_ref.reshape(1), reduction_length=n, name=f"MTP, {where}")
    state = gather_full_state(model, groups.pp)  # collective over tp, ep and pp
    if dist.get_rank() == 0:
        assert state is not None
        assert sorted(state) == sorted(gpt_parameter_names(config))
        save_hf_checkpoint(state, out_dir, config=config, base_config=hf_dir,
                           max_shard_size=SHARD_BYTES)  # fmt: skip


LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 1, 1), "ep2": (1, 1, 2), "pp2": (1, 2, 1)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_deepseek_v3_import_matches_transformers_and_export_is_identical(
    dist_pool: DistPool, deepseek: Checkpoint, tmp_path: Path, name: str
) -> None:

    hf_dir, layout = deepseek[0], LAYOUTS[name]
    out = tmp_path / "export"
    world = layout[0] * layout[1] * layout[2]
    dist_pool.run(_import_export, world, args=(str(hf_dir), str(out), layout, deepseek))
    # the MTP tensors are exported too (transformers ignores them on reading)
    exported = assert_export_identical(
        hf_dir, out, "DeepseekV3ForCausalLM", deepseek[1][:, :-1], deepseek[2]
    )
    mtp = f"model.layers.{LAYERS}."
    kept = ("eh_proj.weight", "shared_head.head.weight", "mlp.gate.e_score_correction_bias",
            "self_attn.kv_a_proj_with_mqa.weight", "mlp.experts.15.down_proj.weight")  # fmt: skip
    for name in kept:
        assert mtp + name in exported, name


def test_deepseek_v3_yarn_matches_transformers(
    dist_pool: DistPool, deepseek_yarn: Checkpoint, tmp_path: Path
) -> None:
    hf_dir = deepseek_yarn[0]
    config = gpt_config_from_hf(hf_dir)
    assert (config.rope_scaling_factor, config.rope_original_max_position) == (4.0, 16)
    assert (config.rope_mscale, config.rope_mscale_all_dim) == (1.0, 1.0)
    _round_trip(dist_pool, deepseek_yarn, tmp_path)


def test_deepseek_v3_plain_query_ungrouped_rotate_half_matches_transformers(
    dist_pool: DistPool, tmp_path: Path
) -> None:
    """DeepSeek-V2-Lite-like pieces: a plain q_proj (no q_lora_rank), one expert group,
    rope rows already in rotate-half order (rope_interleave false: copied as they are)."""
    checkpoint = _checkpoint(tmp_path / "hf", q_lora_rank=None, n_group=1, topk_group=1,
                             rope_interleave=False)  # fmt: skip
    config = gpt_config_from_hf(checkpoint[0])
    assert (config.q_lora_rank, config.moe_num_groups) == (None, None)
    assert not hf_layout(checkpoint[0]).rope_interleave
    assert "model.layers.0.self_attn.q_proj.weight" in read_all(checkpoint[0])
    _round_trip(dist_pool, checkpoint, tmp_path)


def _round_trip(dist_pool: DistPool, checkpoint: Checkpoint, tmp_path: Path) -> None:
    """Logits and MTP loss at tp 1; the export has the same tensors and config.json."""
    hf_dir, out = checkpoint[0], tmp_path / "export"
    dist_pool.run(_import_export, 1, args=(str(hf_dir), str(out), (1, 1, 1), checkpoint))
    original, exported = read_all(hf_dir), read_all(out)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    written = json.loads((out / "config.json").read_text())
    source = json.loads((hf_dir / "config.json").read_text())
    assert {k: written.get(k) for k in source} == source
    assert gpt_config_from_hf(out) == gpt_config_from_hf(hf_dir)


def test_deepseek_v3_config_both_ways(deepseek: Checkpoint) -> None:
    config = gpt_config_from_hf(deepseek[0])
    assert config.attention == "mla" and config.mtp_num_layers == 1
    assert (config.q_lora_rank, config.kv_lora_rank, config.v_head_dim) == (16, 8, 6)
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.head_dim) == (8, 4, 12)
    assert (config.moe_layer_pattern, config.moe_shared_expert_size) == ("-EE", 16)
    assert (config.moe_num_groups, config.moe_group_topk, config.moe_group_score_topk) == (4, 2, 2)
    assert config.moe_score_function == "sigmoid" and config.moe_normalize_topk
    assert config.moe_expert_bias and config.moe_scaling_factor == 2.5
    assert config.rope_theta == ROPE_THETA and config.num_query_groups is None
    layout = hf_layout(deepseek[0])
    assert layout.mla and layout.q_lora and layout.rope_interleave and layout.num_layers == 3
    assert default_architecture(config) == "DeepseekV3ForCausalLM"
    written = hf_config_from_gpt(config)
    assert gpt_config_from_hf(written) == config
    plain = config.replace(q_lora_rank=None, moe_num_groups=None, moe_group_topk=None,
                           moe_group_score_topk=None, mtp_num_layers=0)  # fmt: skip
    again = hf_config_from_gpt(plain)
    assert (again["q_lora_rank"], again["n_group"], again["num_nextn_predict_layers"]) == (
        None, 1, 0,
    )  # fmt: skip
    assert gpt_config_from_hf(again) == plain
    tiny = model_config("deepseek-v3-tiny")  # 4 // 2 = 2: both group rules agree
    assert gpt_config_from_hf(hf_config_from_gpt(tiny)) == tiny.replace(
        moe_group_score_topk=2,
        moe_seq_aux_loss_coeff=0.0,  # the loss is not mapped
    )


@pytest.mark.parametrize("first_dense", [0, 1, 2])
def test_dense_layers_are_where_transformers_builds_them(first_dense: int) -> None:
    import transformers

    hf = _hf_config(first_k_dense_replace=first_dense)
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(hf)
    sparse = "".join(
        "E" if type(layer.mlp).__name__ == "DeepseekV3MoE" else "-" for layer in model.model.layers
    )
    config = gpt_config_from_hf({**hf.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]})
    assert "".join("E" if config.is_moe_layer(i) else "-" for i in range(LAYERS)) == sparse
    assert hf_config_from_gpt(config)["first_k_dense_replace"] == first_dense


def test_rope_rows_permute_and_back() -> None:
    rows = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(12, 3)  # 2 heads [nope 2, rope 4]
    mine = deinterleave_rope(rows, 6, 2, 4)
    assert mine[:, 0].tolist() == [0, 3, 6, 12, 9, 15, 18, 21, 24, 30, 27, 33]
    assert torch.equal(interleave_rope(mine, 6, 2, 4), rows)


def test_deepseek_v3_bad_input_fails_in_one_sentence(deepseek: Checkpoint) -> None:
    base = json.loads((deepseek[0] / "config.json").read_text())
    cases: list[tuple[dict[str, Any], tuple[str, ...]]] = [
        ({"attention_bias": True}, ("attention_bias (True)", "DeepseekV3ForCausalLM")),
        ({"moe_layer_freq": 2}, ("moe_layer_freq (2)", "set it to 1")),
        ({"scoring_func": "softmax"}, ("scoring_func ('softmax')", "sigmoid")),
        ({"topk_method": "greedy"}, ("topk_method ('greedy')", "noaux_tc")),
        ({"num_key_value_heads": 2}, ("num_key_value_heads (2)", "num_attention_heads")),
        ({"n_shared_experts": 0}, ("n_shared_experts (0)", "shared expert")),
        ({"first_k_dense_replace": 3}, ("first_k_dense_replace (3)", "0 to 2")),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, ("rope_type ('linear')",)),
        ({"hidden_act": "gelu"}, ("hidden_act ('gelu')", "silu")),
    ]
    for change, words in cases:
        with pytest.raises(ValueError) as err:
            gpt_config_from_hf({**base, **change})
        one_sentence(err, *words)
    mine = gpt_config_from_hf(base)
    exports: list[tuple[GPTConfig, str | None, tuple[str, ...]]] = [
        (mine.replace(moe_layer_pattern="E-E"), None, ("moe_layer_pattern ('E-E')", "first")),
        (mine.replace(moe_shared_expert_size=24), None, ("moe_shared_expert_size (24)",)),
        (mine.replace(moe_shared_expert_gate=True), None, ("moe_shared_expert_gate (True)",)),
        (mine.replace(moe_group_score_topk=None), None, ("moe_group_score_topk (1)", "2")),
        (mine, "LlamaForCausalLM", ("attention ('mla')", "DeepseekV3ForCausalLM")),
        (mine.replace(attention="mha", q_lora_rank=None, kv_lora_rank=None,
                      qk_nope_head_dim=None, qk_rope_head_dim=None, v_head_dim=None),
         "DeepseekV3ForCausalLM", ("attention 'mha'", "attention='mla'")),
    ]  # fmt: skip
    for config, arch, words in exports:
        with pytest.raises(ValueError) as err:
            hf_config_from_gpt(config, arch)
        one_sentence(err, *words)


@pytest.mark.skipif(
    importlib.util.find_spec("mega_pretrain") is None, reason="needs the mega-pretrain app"
)
def test_deepseek_v3_through_the_trainers_convert(deepseek: Checkpoint, tmp_path: Path) -> None:
    """``mega-pretrain convert`` into a run folder and back: every tensor (the correction
    biases in the trainer's checkpoint, the MTP depth) and the config.json come back."""
    env = {**os.environ, "MEGA_PRETRAIN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    hf_dir, run, out = deepseek[0], tmp_path / "run", tmp_path / "out"
    for args in (["--from-hf", str(hf_dir), "--to", str(run), "--train.seq_len", "32"],
                 ["--to-hf", str(out), "--from", str(run), "--train.seq_len", "32"]):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "mega_pretrain", "convert", *args],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
    original, exported = read_all(hf_dir), read_all(out)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    written = json.loads((out / "config.json").read_text())
    source = json.loads((hf_dir / "config.json").read_text())
    assert {k: written.get(k) for k in source} == source
