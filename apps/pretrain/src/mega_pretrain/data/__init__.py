"""The data pipeline: tokenizers, the indexed token format (and Megatron's, read as is),
preprocessing, GPT samples, blends, train/valid splits and the resumable data-parallel sampler."""

from mega_pretrain.data.blended import BlendedDataset, blend_order
from mega_pretrain.data.corpus import default_cache_dir, default_corpus, ensure_default_dataset
from mega_pretrain.data.dataset import GPTDataset, SampleDataset
from mega_pretrain.data.documents import DocumentSubset, TokenSource
from mega_pretrain.data.errors import DataError
from mega_pretrain.data.indexed import (
    IndexedTokenDataset,
    IndexedTokenWriter,
    IndexHeader,
    check_vocab,
)
from mega_pretrain.data.megatron import MegatronIndex
from mega_pretrain.data.preprocess import PreprocessStats, find_input_files, preprocess
from mega_pretrain.data.sampler import DistributedBatchSampler
from mega_pretrain.data.split import SampleSubset, split_train_valid
from mega_pretrain.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    build_tokenizer,
)

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
