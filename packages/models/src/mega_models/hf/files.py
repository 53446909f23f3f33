"""The files of a Hugging Face model folder beside its weights: config, generation
config and tokenizer, copied as they are so an export carries what the import read."""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["HF_SIDE_FILES", "copy_side_files"]

#: Files of a model folder that are not weights and that an export hands on unchanged.
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def copy_side_files(src: str | Path, dst: str | Path, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy each of :data:`HF_SIDE_FILES` that ``src`` holds (except ``skip``) into ``dst``.

    Returns the names copied. Weights and sub-folders are never copied.
    """
    source, target = Path(src), Path(dst)
    names = [n for n in HF_SIDE_FILES if n not in skip and (source / n).is_file()]
    if names:
        target.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(source / name, target / name)
    return names
