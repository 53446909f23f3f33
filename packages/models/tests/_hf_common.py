"""Helpers both Hugging Face bridge test files use: tiny random checkpoints and their reading."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mega_models import GPTModel
from mega_parallel_grid import ProcessGroups
from mega_parallel_grid.testing import rank_device
from mega_tp_layers import gather_from_tp_region


def randomise(model: Any) -> Any:
    """Draw every weight again (norms near 1, the rest small): a trained-looking model."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.08 * noise)
    return model


def save(model: Any, out: Path, shard_bytes: int) -> None:
    """``save_pretrained`` as safetensors shards of at most ``shard_bytes`` (plus the index)."""
    kwargs: dict[str, Any] = {"max_shard_size": shard_bytes}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers 4.x; 5.x writes only safetensors
    model.save_pretrained(out, **kwargs)


def saved_checkpoints(
    models: dict[str, Callable[[], Any]], root: pytest.TempPathFactory, shard_bytes: int,
    batch: int, seq: int,
) -> dict[str, tuple[Path, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Per architecture of ``models`` (its name -> a maker of a seeded transformers model):
    the sharded checkpoint saved under ``root``, token ids ``[batch, seq]`` (the first row
    ending on the last real row of the padded vocabulary) and transformers' logits for them."""
    out = {}
    for arch, make in models.items():
        model = make()
        path = root.mktemp(arch)
        save(model, path, shard_bytes)
        assert (path / "model.safetensors.index.json").is_file()
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(2))
        ids[0, -1] = vocab - 1
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        out[arch] = (path, ids, logits)
    return out


def read_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def forward_stages(
    model: GPTModel, groups: ProcessGroups, ids: torch.Tensor
) -> torch.Tensor | None:
    """Forward through the pipeline by hand; the last stage returns the full logits [b, s, V]."""
    pp, me, dev = groups.size("pp"), groups.rank("pp"), rank_device()
    ranks = dist.get_process_group_ranks(groups.pp)
    x = ids.to(dev)
    if not model.stage.first:
        x = torch.empty(ids.shape[1], ids.shape[0], model.config.hidden_size, device=dev)
        dist.recv(x, ranks[me - 1])
    with torch.no_grad():
        out = model(x)
    if not model.stage.last:
        dist.send(out.contiguous(), ranks[me + 1])
        return None
    assert pp == 1 or not model.stage.first
    full = gather_from_tp_region(out, groups.tp)  # [b, s, V_pad/tp] -> [b, s, V_pad]
    return full[..., : model.config.vocab_size].cpu()


def one_sentence(err: pytest.ExceptionInfo[BaseException], *words: str) -> None:
    """The error is one line and names every one of ``words``."""
    text = str(err.value)
    assert "\n" not in text, text
    for word in words:
        assert word in text, (word, text)
