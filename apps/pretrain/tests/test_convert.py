"""convert: a Hugging Face Llama into a mega run folder, back out unchanged, and trained on;
every architecture's config.json, generation config and tokenizer files survive the trip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers  # the [hf] extra; installed in the dev environment

from mega_parallel_grid.testing import DistPool
from mega_pretrain.cli import main


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MEGA_PRETRAIN_CACHE": str(cwd / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "mega_pretrain", *args], cwd=cwd, env=env, text=True,
        capture_output=True, timeout=300, check=False,
    )  # fmt: skip


def _main_here(argv: list[str]) -> int:
    """The command line in this process: a pool worker's world of one is the run's group."""
    return main(argv)


def test_convert_needs_both_ends(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "--from-hf", str(tmp_path)]) == 2
    assert "convert needs --from-hf DIR --to RUN_DIR" in capsys.readouterr().err


# tiny configs with special-token ids other than transformers' defaults (bos 1, eos 2)
TOKENS = {"bos_token_id": 3, "eos_token_id": 4, "pad_token_id": 0}
SHAPES = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"max_position_embeddings": 256}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 128}),  # window < max
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                   "shared_expert_intermediate_size": 40, "decoder_sparse_step": 2}),
}  # fmt: skip
# keys the export adds for transformers 4.x readers (5.x has them in rope_parameters / dtype)
COMPAT_KEYS = {"rope_theta", "torch_dtype"}
SIDE_FILES = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}\n',
    "tokenizer_config.json": '{"bos_token": "<s>", "eos_token": "</s>", "model_max_length": 256}',
    "special_tokens_map.json": '{"bos_token": "<s>", "eos_token": "</s>"}',
}


def _import_export(
    family: str, tmp_path: Path, dist_pool: DistPool | None = None
) -> tuple[Path, Path]:
    """The family's seeded tiny model saved by transformers, converted into a run and out again
    (through a ``mega-pretrain`` process each way, or in a pool worker with ``dist_pool``)."""
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**SHAPES, **TOKENS, **extra)
    torch.manual_seed(0)
    hf = tmp_path / "hf"
    getattr(transformers, model_cls)(config).save_pretrained(hf)
    generation = transformers.GenerationConfig(bos_token_id=3, eos_token_id=[4, 5], temperature=0.7,
                                               do_sample=True, pad_token_id=0)  # fmt: skip
    generation.save_pretrained(hf)
    for name, text in SIDE_FILES.items():
        (hf / name).write_text(text)
    run, out = tmp_path / "runs" / family, tmp_path / "hf-out"
    for argv in (["convert", "--from-hf", str(hf), "--to", str(run)],
                 ["convert", "--to-hf", str(out), "--from", str(run)]):  # fmt: skip
        if dist_pool is not None:
            assert dist_pool.run(_main_here, 1, args=(argv,)) == [0]
        else:
            done = _run(argv, tmp_path)
            assert done.returncode == 0, done.stderr
    return hf, out


def _check_config_and_side_files(hf: Path, out: Path) -> None:
    source = json.loads((hf / "config.json").read_text())
    written = json.loads((out / "config.json").read_text())
    assert {k: written.get(k, "missing") for k in source} == source
    assert set(written) - set(source) <= COMPAT_KEYS
    loaded = transformers.AutoConfig.from_pretrained(out)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (3, 4, 0)
    for name in ("generation_config.json", *SIDE_FILES):
        assert (out / name).read_bytes() == (hf / name).read_bytes(), name
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.eos_token_id, generation.temperature) == ([4, 5], 0.7)


def test_llama_round_trip_and_training(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    hf, out = _import_export("llama", tmp_path)
    _check_config_and_side_files(hf, out)
    original = load_file(hf / "model.safetensors")
    exported: dict[str, torch.Tensor] = {}
    for file in out.glob("*.safetensors"):
        exported.update(load_file(file))
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    run = tmp_path / "runs/llama"
    done = _run(["--config", str(run / "model.toml"), "--train.steps", "3",
                 "--train.seq_len", "32", "--train.micro_batch_size", "2",
                 "--train.global_batch_size", "4", "--train.log_interval", "1",
                 "--train.warmup_steps", "1"], tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stdout and "step      3/3" in done.stdout
    # a kept config.json of other dimensions than the run's model: one sentence, no export
    kept = run / "hf" / "config.json"
    kept.write_text(json.dumps({**json.loads(kept.read_text()), "vocab_size": 512}))
    done = _run(["convert", "--to-hf", str(tmp_path / "out2"), "--from", str(run)], tmp_path)
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert "vocab_size 512 but the model to export has 300" in line, line
    assert f"delete {run / 'hf'}" in line, line


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_whole_config_and_side_files_round_trip(
    dist_pool: DistPool, tmp_path: Path, family: str
) -> None:
    """In a pool worker: the command line's own process is llama's test."""
    _check_config_and_side_files(*_import_export(family, tmp_path, dist_pool))
