"""The export check the Hugging Face family tests share: a round trip is the identity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from _hf_common import read_all


def assert_export_identical(
    hf_dir: Path, out: Path, architecture: str, ids: torch.Tensor, logits: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The export ``out`` of checkpoint ``hf_dir`` holds its tensors bitwise (names and
    dtypes) and its config.json (every key), and transformers reads it back as
    ``architecture`` with the reference ``logits`` for ``ids``. Returns the exported tensors."""
    import transformers

    original, exported = read_all(hf_dir), read_all(out)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name
    written = json.loads((out / "config.json").read_text())
    source = json.loads((hf_dir / "config.json").read_text())
    assert {k: written.get(k) for k in source} == source  # every key, special tokens included
    assert set(written) - set(source) <= {"rope_theta", "torch_dtype"}  # for 4.x readers
    theirs, mine = (transformers.AutoConfig.from_pretrained(p).to_dict() for p in (hf_dir, out))
    assert {**mine, "_name_or_path": ""} == {**theirs, "_name_or_path": ""}
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == architecture
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, logits)
    return exported
