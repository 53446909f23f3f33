"""The data pipeline: tokenizers, the indexed token format (and Megatron's, read as is),
preprocessing, GPT samples, blends, train/valid splits and the resumable data-parallel sampler.

The names that need torch (datasets, blends, splits, the sampler) load on first use (PEP 562
``__getattr__``), so that a preprocess worker process, which needs only the readers, the
tokenizers and the writer, does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mega_pretrain.data.corpus import default_cache_dir, default_corpus, ensure_default_dataset
from mega_pretrain.data.documents import DocumentSubset, TokenSource
from mega_pretrain.data.errors import DataError
from mega_pretrain.data.indexed import (
    IndexedTokenDataset,
    IndexedTokenWriter,
    IndexHeader,
)
from mega_pretrain.data.megatron import MegatronIndex
from mega_pretrain.data.preprocess import PreprocessStats, find_input_files, preprocess
from mega_pretrain.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    build_tokenizer,
)
from mega_pretrain.data.vocab_check import check_vocab

if TYPE_CHECKING:
    from mega_pretrain.data.blended import BlendedDataset, blend_order
    from mega_pretrain.data.dataset import GPTDataset, SampleDataset
    from mega_pretrain.data.sampler import DistributedBatchSampler
    from mega_pretrain.data.split import SampleSubset, split_train_valid

__all__ = [
    "BlendedDataset",
    "ByteTokenizer",
    "DataError",
    "DistributedBatchSampler",
    "DocumentSubset",
    "GPTDataset",
    "HFTokenizer",
    "IndexHeader",
    "IndexedTokenDataset",
    "IndexedTokenWriter",
    "MegatronIndex",
    "PreprocessStats",
    "SampleDataset",
    "SampleSubset",
    "TiktokenTokenizer",
    "TokenSource",
    "Tokenizer",
    "blend_order",
    "build_tokenizer",
    "check_vocab",
    "default_cache_dir",
    "default_corpus",
    "ensure_default_dataset",
    "find_input_files",
    "preprocess",
    "split_train_valid",
]

_HOME = {
    "BlendedDataset": "blended",
    "DistributedBatchSampler": "sampler",
    "GPTDataset": "dataset",
    "SampleDataset": "dataset",
    "SampleSubset": "split",
    "blend_order": "blended",
    "split_train_valid": "split",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'mega_pretrain.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"mega_pretrain.data.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
