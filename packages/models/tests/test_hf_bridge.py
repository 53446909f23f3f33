"""HF bridge: a tiny random Llama / Mistral / Qwen2 built with ``transformers`` (no download),
imported at tp x pp, gives transformers' logits; exported back, it gives the same tensors.

``transformers`` is imported only in the pytest process (inside the fixtures): the rank
workers import this module too, and need only torch, mega and safetensors.
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _hf_common import forward_stages, one_sentence, randomise, read_all, saved_checkpoints

from mega_models import GPTModel, stage_spec
from mega_models.hf import (
    HFLayout,
    fuse_qkv,
    gather_full_state,
    gpt_config_from_hf,
    hf_config_from_gpt,
    hf_state_dict,
    interleave_gate_up,
    load_hf_weights,
    save_hf_checkpoint,
    split_gate_up,
    split_qkv,
    write_safetensors,
)
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device, solo_groups

# fp32 on both sides, same formulas: the only differences are the order of float sums
# (tp splits the attention-output and MLP-down GEMM reductions and adds the partial sums;
# SDPA and GEMM kernels may block differently). Logits are compared with rtol 1e-5 and an
# absolute tolerance of 1e-5 of the largest logit (~80 fp32 ulps at that magnitude); a
# wrong layout (an unpermuted head, a swapped gate/up, a shifted vocab row) is off by
# O(1) of the logits' scale.
RTOL = 1e-5
BATCH, SEQ = 2, 12
SHARD_BYTES = 40_000  # a few shards per checkpoint: exercises the index

SHAPES: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
}
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              {"vocab_size": 257, "num_hidden_layers": 4, "rms_norm_eps": 1e-5}),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                {"vocab_size": 300, "num_hidden_layers": 2}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              {"vocab_size": 257, "num_hidden_layers": 2, "tie_word_embeddings": True}),
}  # fmt: skip
ROPE_THETA = 50_000.0


def _hf_model(arch: str) -> Any:
    """A seeded random transformers model; norm scales and biases are randomised too, so a
    swapped norm or a dropped bias shows in the logits."""
    import transformers

    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(**SHAPES, **extra)
    if hasattr(config, "rope_parameters") and isinstance(config.rope_parameters, dict):
        config.rope_parameters["rope_theta"] = ROPE_THETA
    config.rope_theta = ROPE_THETA
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    return randomise(model)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any, Any]]:
    """Per architecture: the saved directory, token ids [b, s] and transformers' logits."""
    models = {arch: partial(_hf_model, arch) for arch in ARCHS}
    return saved_checkpoints(models, tmp_path_factory, SHARD_BYTES, BATCH, SEQ)


def _import_export(
    hf_dir: str, out_dir: str, tp: int, pp: int, ids: torch.Tensor, ref: torch.Tensor
) -> None:
    groups = init_process_groups(ParallelConfig(tp=tp, pp=pp))
    config = gpt_config_from_hf(hf_dir)
    stage = stage_spec(config.num_layers, pp, groups.rank("pp"))
    model = GPTModel(config, groups, stage=stage, seed=5, device=rank_device()).eval()
    load_hf_weights(model, hf_dir)
    logits = forward_stages(model, groups, ids)
    if logits is not None:
        atol = RTOL * float(ref.abs().max())
        torch.testing.assert_close(logits, ref, rtol=RTOL, atol=atol)
    if tp > 1:  # a tp shard alone cannot be exported: it must be gathered first
        with pytest.raises(ValueError, match=r"split over tp \(2\)") as err:
            save_hf_checkpoint(model, out_dir)
        assert "\n" not in str(err.value)
    state = gather_full_state(model, groups.pp)  # collective over tp and pp
    assert (state is None) == (groups.rank("pp") != 0)
    if dist.get_rank() != 0:
        return
    assert state is not None
    if tp == pp == 1:
        save_hf_checkpoint(model, out_dir, base_config=hf_dir, max_shard_size=SHARD_BYTES)
        save_hf_checkpoint([model], out_dir + "-bf16", base_config=hf_dir, dtype=torch.bfloat16)
    else:
        save_hf_checkpoint(state, out_dir, config=config, base_config=hf_dir,
                           max_shard_size=SHARD_BYTES)  # fmt: skip


LAYOUTS = [
    ("llama", 1, 1),
    ("llama", 2, 1),
    ("llama", 1, 2),
    ("llama", 2, 2),
    ("mistral", 2, 2),
    ("qwen2", 2, 2),
]


@pytest.mark.parametrize(("arch", "tp", "pp"), LAYOUTS, ids=str)
def test_import_matches_transformers_and_export_is_identical(
    dist_pool: DistPool,
    checkpoints: dict[str, tuple[Path, Any, Any]],
    tmp_path: Path,
    arch: str,
    tp: int,
    pp: int,
) -> None:
    hf_dir, ids, ref = checkpoints[arch]
    out = tmp_path / "export"
    dist_pool.run(_import_export, tp * pp, args=(str(hf_dir), str(out), tp, pp, ids, ref))
    assert (out / "model.safetensors.index.json").is_file()
    original, exported = read_all(hf_dir), read_all(out)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name
    assert gpt_config_from_hf(out) == gpt_config_from_hf(hf_dir)
    written = json.loads((out / "config.json").read_text())
    source = json.loads((hf_dir / "config.json").read_text())
    assert written["architectures"] == source["architectures"]
    if tp == pp == 1:  # one file (no size limit), cast on the way out
        bf16 = tmp_path / "export-bf16"
        assert not (bf16 / "model.safetensors.index.json").exists()
        halves = read_all(bf16)
        assert all(torch.equal(halves[n], t.to(torch.bfloat16)) for n, t in original.items())
        assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    if arch == "qwen2":  # transformers itself reads the export: the same weights, same code
        _check_from_pretrained(out, ids, ref)


def _check_from_pretrained(out: Path, ids: torch.Tensor, ref: torch.Tensor) -> None:
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(out)
    model.eval()
    assert type(model).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert torch.equal(logits, ref)


def test_config_from_hf_fields(checkpoints: dict[str, tuple[Path, Any, Any]]) -> None:
    llama = gpt_config_from_hf(checkpoints["llama"][0])
    assert (llama.vocab_size, llama.hidden_size, llama.num_layers) == (257, 64, 4)
    assert (llama.num_attention_heads, llama.kv_heads, llama.ffn_size) == (4, 2, 128)
    assert (llama.norm, llama.activation, llama.position) == ("rmsnorm", "swiglu", "rope")
    assert (llama.norm_eps, llama.rope_theta) == (1e-5, ROPE_THETA)
    assert not llama.tie_embeddings and not llama.add_bias
    qwen = gpt_config_from_hf(checkpoints["qwen2"][0])
    assert qwen.tie_embeddings and qwen.qkv_bias and not qwen.add_bias  # q/k/v biases only
    # transformers 4.x layout: rope_theta at the top level, Mistral's window caps max_seq_len
    legacy = {
        "architectures": ["MistralForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
        "vocab_size": 300, "rope_theta": 1e6, "rope_scaling": None, "sliding_window": 512,
        "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
    }  # fmt: skip
    mistral = gpt_config_from_hf(legacy)
    assert (mistral.rope_theta, mistral.max_seq_len, mistral.kv_heads) == (1e6, 512, 2)
    # written back, it reads the same
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        back = gpt_config_from_hf(hf_config_from_gpt(llama, arch))
        assert back.replace(qkv_bias=False) == llama
        assert back.qkv_bias == (arch == "Qwen2ForCausalLM")
    # q/k/v biases alone: Qwen2 by default, Llama only through attention_bias (o_proj zero)
    assert hf_config_from_gpt(qwen)["architectures"] == ["Qwen2ForCausalLM"]
    as_llama = gpt_config_from_hf(hf_config_from_gpt(qwen, "LlamaForCausalLM"))
    assert as_llama.add_bias and not as_llama.qkv_bias


def test_layout_helpers_invert() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, 5, generator=gen) for rows in (8 * 3, 2 * 3, 2 * 3))
    fused = fuse_qkv(q, k, v, kv_heads=2)  # heads 8, kv 2, head dim 3
    assert torch.equal(fused[:18], torch.cat([q[:12], k[:3], v[:3]]))  # group 0 first
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, 8, 2), (q, k, v), strict=True))
    gate, up = torch.randn(6, 4, generator=gen), torch.randn(6, 4, generator=gen)
    fc1 = interleave_gate_up(gate, up)
    assert torch.equal(fc1[0], gate[0]) and torch.equal(fc1[1], up[0])
    assert all(torch.equal(a, b) for a, b in zip(split_gate_up(fc1), (gate, up), strict=True))


def test_bad_configs_fail_inone_sentence(checkpoints: dict[str, tuple[Path, Any, Any]]) -> None:
    base = json.loads((checkpoints["llama"][0] / "config.json").read_text())
    with pytest.raises(ValueError) as err:
        gpt_config_from_hf({**base, "architectures": ["GPT2LMHeadModel"]})
    one_sentence(err, "GPT2LMHeadModel", "not supported", "LlamaForCausalLM")
    with pytest.raises(ValueError) as err:
        gpt_config_from_hf({**base, "architectures": ["Phi3ForCausalLM"]})
    one_sentence(err, "Phi3ForCausalLM", "not supported", "MixtralForCausalLM")
    scaled = {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}
    with pytest.raises(ValueError) as err:
        gpt_config_from_hf(scaled)
    one_sentence(err, "llama3", "RoPE scaling")
    with pytest.raises(ValueError) as err:
        gpt_config_from_hf({**base, "head_dim": 32})
    one_sentence(err, "head_dim (32)")
    with pytest.raises(ValueError) as err:
        gpt_config_from_hf({**base, "hidden_act": "gelu"})
    one_sentence(err, "hidden_act ('gelu')")
    with pytest.raises(ValueError) as err:
        gpt_config_from_hf(checkpoints["llama"][0] / "missing")
    one_sentence(err, "config.json", "does not exist")


def _broken(src: Path, dst: Path, how: str) -> Path:
    """A copy of ``src`` with one defect."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    index_file = dst / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    target = "model.layers.1.mlp.up_proj.weight"
    file = dst / index["weight_map"][target]
    if how == "missing_file":
        file.unlink()
    elif how == "missing_tensor":
        del index["weight_map"][target]
        index_file.write_text(json.dumps(index))
    else:  # a tensor of the wrong shape
        tensors = load_file(str(file))
        tensors[target] = tensors[target][:-1].clone()
        save_file(tensors, str(file), metadata={"format": "pt"})
    return dst


def _load_errors(dirs: dict[str, str], good: str) -> dict[str, str]:
    """Each broken directory's error message when loaded into a tp-1 model (one rank)."""
    groups = solo_groups()
    messages = {}
    for how, path in dirs.items():
        model = GPTModel(gpt_config_from_hf(good), groups)
        try:
            load_hf_weights(model, path)
        except ValueError as exc:
            messages[how] = str(exc)
    mismatched = GPTModel(gpt_config_from_hf(good).replace(rope_theta=1e4), groups)
    try:
        load_hf_weights(mismatched, good)
    except ValueError as exc:
        messages["config"] = str(exc)
    model = GPTModel(gpt_config_from_hf(good).replace(add_bias=True), groups)
    state = gather_full_state(model)
    assert state is not None
    state["layers.0.attention.qkv.bias"][0] = 1.0
    layout = HFLayout("MistralForCausalLM", qkv_bias=False, proj_bias=False, mlp_bias=False)
    try:
        hf_state_dict(state, model.config, layout)
    except ValueError as exc:
        messages["nonzero_bias"] = str(exc)
    del state["layers.2.mlp.fc2.weight"]
    try:
        save_hf_checkpoint(state, dirs["shape"] + "-out", config=model.config)
    except ValueError as exc:
        messages["incomplete_state"] = str(exc)
    return messages


def test_bad_checkpoints_fail_inone_sentence(
    dist_pool: DistPool, checkpoints: dict[str, tuple[Path, Any, Any]], tmp_path: Path
) -> None:
    good = checkpoints["llama"][0]
    dirs = {how: str(_broken(good, tmp_path / how, how))
            for how in ("missing_file", "missing_tensor", "shape")}  # fmt: skip
    [messages] = dist_pool.run(_load_errors, 1, args=(dirs, str(good)))
    expected = {
        "missing_file": ("shard file", "model.layers.1.mlp.up_proj.weight", "does not exist"),
        "missing_tensor": ("model.layers.1.mlp.up_proj.weight", "is not in the checkpoint"),
        "shape": ("model.layers.1.mlp.up_proj.weight", "(127, 64)", "(128, 64)"),
        "config": ("rope_theta (10000.0)", "(50000.0)", "gpt_config_from_hf"),
        "nonzero_bias": ("layers.0.attention.qkv.bias", "MistralForCausalLM", "not zero"),
        "incomplete_state": ("layers.2.mlp.fc2.weight", "missing"),
    }
    assert sorted(messages) == sorted(expected)
    for how, words in expected.items():
        assert "\n" not in messages[how], messages[how]
        for word in words:
            assert word in messages[how], (how, word, messages[how])


def test_export_refuses_a_non_empty_directory(
    checkpoints: dict[str, tuple[Path, Any, Any]],
) -> None:
    with pytest.raises(ValueError) as err:
        write_safetensors({"x": torch.zeros(2)}, checkpoints["llama"][0], SHARD_BYTES)
    one_sentence(err, "already holds a checkpoint", "empty directory")


def test_export_keeps_the_base_config_keys(checkpoints: dict[str, tuple[Path, Any, Any]]) -> None:
    """Every key of the config.json a model came from comes back: the keys the export does
    not own unchanged, the owned ones where they read as the same model."""
    from mega_models.hf import check_base_config

    tokens = {"bos_token_id": 128000, "eos_token_id": [128001, 128009], "pad_token_id": None}
    for arch in ARCHS:
        source = {**json.loads((checkpoints[arch][0] / "config.json").read_text()), **tokens}
        written = hf_config_from_gpt(gpt_config_from_hf(source), base=source)
        assert {k: written.get(k, "missing") for k in source} == {**source, "dtype": "float32"}
    # 4.x spellings: Mistral's max_position_embeddings beyond its window, Qwen2's unused window
    legacy = {
        "architectures": ["MistralForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
        "vocab_size": 300, "rope_theta": 1e6, "rope_scaling": None, "sliding_window": 512,
        "max_position_embeddings": 32768, "torch_dtype": "float32", "eos_token_id": 7,
    }  # fmt: skip
    qwen = {**legacy, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False,
            "sliding_window": 131072, "max_window_layers": 28}  # fmt: skip
    for source in (legacy, qwen):
        config = gpt_config_from_hf(source)
        written = hf_config_from_gpt(config, base=source)
        assert {k: written.get(k, "missing") for k in source} == source
        assert gpt_config_from_hf(written) == config
    # the shape keys are the model's, and a base of another model's dimensions is refused
    llama = gpt_config_from_hf(checkpoints["llama"][0])
    with pytest.raises(ValueError) as err:
        check_base_config(llama.replace(hidden_size=128), checkpoints["llama"][0], "way out")
    one_sentence(err, "hidden_size 64", "has 128", "way out", str(checkpoints["llama"][0]))
