"""convert: a Hugging Face Llama into a mega run folder, back out unchanged, and trained on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import transformers  # the [hf] extra; installed in the dev environment


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MEGA_PRETRAIN_CACHE": str(cwd / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "mega_pretrain", *args], cwd=cwd, env=env, text=True,
        capture_output=True, timeout=300, check=False,
    )  # fmt: skip


def test_llama_round_trip_and_training(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    hf = tmp_path / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(hf, safe_serialization=True)
    done = _run(["convert", "--from-hf", str(hf), "--to", str(tmp_path / "runs/llama")], tmp_path)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "hf-out"
    done = _run(["convert", "--to-hf", str(out), "--from", str(tmp_path / "runs/llama")], tmp_path)
    assert done.returncode == 0, done.stderr
    original = load_file(hf / "model.safetensors")
    exported: dict[str, torch.Tensor] = {}
    for file in out.glob("*.safetensors"):
        exported.update(load_file(file))
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    done = _run(["--config", str(tmp_path / "runs/llama/model.toml"), "--train.steps", "3",
                 "--train.seq_len", "32", "--train.micro_batch_size", "2",
                 "--train.global_batch_size", "4", "--train.log_interval", "1"], tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stdout and "step      3/3" in done.stdout


def test_convert_needs_both_ends(tmp_path: Path) -> None:
    done = _run(["convert", "--from-hf", str(tmp_path)], tmp_path)
    assert done.returncode == 2
    assert "convert needs --from-hf DIR --to RUN_DIR" in done.stderr
