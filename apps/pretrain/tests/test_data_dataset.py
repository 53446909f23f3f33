"""GPTDataset samples are windows of the reference concatenation, in an order fixed by the seed;
train/valid splits are deterministic and disjoint."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from mega_pretrain.data import (
    DataError,
    DocumentSubset,
    GPTDataset,
    IndexedTokenDataset,
    IndexedTokenWriter,
    split_train_valid,
)

EOD = 256


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[IndexedTokenDataset, list[np.ndarray]]:
    """40 documents of random lengths (each ending with EOD) and the list they came from."""
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, 256, size=int(n)), EOD) for n in rng.integers(0, 60, 40)]
    with IndexedTokenWriter(tmp_path / "c", 257, eod_id=EOD) as writer:
        for doc in docs:
            writer.add_document(doc)
    return IndexedTokenDataset(tmp_path / "c"), docs


def test_samples_are_windows_of_the_concatenation(
    corpus: tuple[IndexedTokenDataset, list[np.ndarray]],
) -> None:
    indexed, docs = corpus
    reference = np.concatenate(docs)  # documents joined, EOD between them
    seq = 7
    ds = GPTDataset(indexed, seq, seed=3)
    assert len(ds) == ds.samples_per_epoch == (reference.size - 1) // seq
    windows = [ds.window_index(i) for i in range(len(ds))]
    assert sorted(windows) == list(range(len(ds)))  # one epoch is a permutation of all windows
    assert windows != sorted(windows)
    for i, j in enumerate(windows):
        sample = ds[i]
        window = reference[j * seq : j * seq + seq + 1]
        assert sample["tokens"].dtype == sample["labels"].dtype == torch.int64
        assert sample["tokens"].tolist() == window[:-1].tolist()  # [s]
        assert sample["labels"].tolist() == window[1:].tolist()  # [s], shifted by one
    # every token but the first is a label exactly once per epoch
    labels = np.concatenate([ds[i]["labels"].numpy() for i in np.argsort(windows)])
    np.testing.assert_array_equal(labels, reference[1 : 1 + len(ds) * seq])
    with pytest.raises(IndexError, match=rf"sample {len(ds)} is out of range"):
        ds[len(ds)]


def test_order_is_fixed_by_the_seed(corpus: tuple[IndexedTokenDataset, list[np.ndarray]]) -> None:
    indexed, _ = corpus
    order = [GPTDataset(indexed, 5, seed=1).window_index(i) for i in range(100)]
    assert order == [GPTDataset(indexed, 5, seed=1).window_index(i) for i in range(100)]
    assert order != [GPTDataset(indexed, 5, seed=2).window_index(i) for i in range(100)]
    plain = GPTDataset(indexed, 5, seed=1, shuffle=False)
    assert [plain.window_index(i) for i in range(100)] == list(range(100))
    ds = GPTDataset(indexed, 5, seed=1)
    again = pickle.loads(pickle.dumps(ds))
    assert all(torch.equal(ds[i]["tokens"], again[i]["tokens"]) for i in range(0, len(ds), 37))


def test_more_samples_than_an_epoch_reshuffle_each_epoch(
    corpus: tuple[IndexedTokenDataset, list[np.ndarray]],
) -> None:
    indexed, _ = corpus
    ds = GPTDataset(indexed, 9, seed=4, num_samples=None)
    e = ds.samples_per_epoch
    long = GPTDataset(indexed, 9, seed=4, num_samples=2 * e + 5)
    assert len(long) == 2 * e + 5
    first = [long.window_index(i) for i in range(e)]
    second = [long.window_index(i) for i in range(e, 2 * e)]
    assert first == [ds.window_index(i) for i in range(e)]  # num_samples does not change epoch 0
    assert sorted(second) == list(range(e)) and second != first
    # reading backwards (cache misses) gives the same windows
    assert [long.window_index(i) for i in reversed(range(2 * e + 5))][::-1][:e] == first


def test_document_subset_feeds_a_dataset(
    corpus: tuple[IndexedTokenDataset, list[np.ndarray]],
) -> None:
    indexed, docs = corpus
    ids = [3, 1, 4, 15, 9, 2, 6]
    reference = np.concatenate([docs[i] for i in ids])
    ds = GPTDataset(DocumentSubset(indexed, ids), 4, seed=0, shuffle=False)
    for i in range(len(ds)):
        np.testing.assert_array_equal(ds.window(i), reference[i * 4 : i * 4 + 5])


def test_split_by_documents_is_deterministic_and_disjoint(
    corpus: tuple[IndexedTokenDataset, list[np.ndarray]],
) -> None:
    indexed, docs = corpus
    train, valid = split_train_valid(indexed, 0.1, seed=5)
    assert (len(train), len(valid)) == (36, 4)
    assert sorted([*train.doc_ids, *valid.doc_ids]) == list(range(40))
    again = split_train_valid(indexed, 0.1, seed=5)[1]
    assert valid.doc_ids.tolist() == again.doc_ids.tolist()
    assert valid.doc_ids.tolist() != split_train_valid(indexed, 0.1, seed=6)[1].doc_ids.tolist()
    expected = np.concatenate([docs[i] for i in valid.doc_ids])
    np.testing.assert_array_equal(valid.tokens(0, valid.num_tokens), expected)
    assert train.num_tokens + valid.num_tokens == indexed.num_tokens
    assert len(split_train_valid(indexed, 0.001, seed=0)[1]) == 1  # at least one document
    assert len(split_train_valid(indexed, 0.0, seed=0)[1]) == 0


def test_split_by_samples_is_deterministic_and_disjoint(
    corpus: tuple[IndexedTokenDataset, list[np.ndarray]],
) -> None:
    indexed, _ = corpus
    ds = GPTDataset(indexed, 8, seed=0)
    train, valid = split_train_valid(ds, 0.25, seed=1)
    assert len(valid) == round(0.25 * len(ds)) and len(train) + len(valid) == len(ds)
    assert sorted([*train.indices, *valid.indices]) == list(range(len(ds)))
    assert torch.equal(valid[2]["labels"], ds[int(valid.indices[2])]["labels"])
    assert valid.indices.tolist() == split_train_valid(ds, 0.25, seed=1)[1].indices.tolist()


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda ix: GPTDataset(ix, 0, seed=0), ValueError, r"seq_len \(0\) must be a positive"),
        (lambda ix: GPTDataset(ix, 4, seed=-1), ValueError, r"seed \(-1\) must be a non-negative"),
        (
            lambda ix: GPTDataset(ix, 10**6, seed=0),
            DataError,
            r"the data has \d+ tokens, fewer than seq_len \+ 1 \(1000001\) that one sample needs",
        ),
        (
            lambda ix: GPTDataset(ix, 4, seed=0, num_samples=-3),
            ValueError,
            r"num_samples \(-3\) must be a non-negative integer, or None for one epoch",
        ),
        (
            lambda ix: split_train_valid(ix, 1.0, seed=0),
            ValueError,
            r"valid_fraction \(1\.0\) must be in \[0, 1\)",
        ),
        (
            lambda ix: split_train_valid(DocumentSubset(ix, [0, 1]), 0.9, seed=0),
            ValueError,
            r"valid_fraction 0\.9 of 2 documents leaves none to train on",
        ),
    ],
)
def test_bad_dataset_arguments_raise_one_sentence(
    corpus: tuple[IndexedTokenDataset, list[np.ndarray]],
    make: object,
    error: type[Exception],
    message: str,
) -> None:
    with pytest.raises(error, match=message) as info:
        make(corpus[0])  # type: ignore[operator]
    assert "\n" not in str(info.value)
