"""Blends follow their weights in every prefix, deterministically, and reuse samples in new orders."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mega_pretrain.data import BlendedDataset, blend_order


class _Labelled:
    """A sample dataset whose sample k of dataset d holds the tokens [d, k]."""

    def __init__(self, d: int, size: int) -> None:
        self.d, self.size = d, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        if not 0 <= k < self.size:
            raise IndexError(k)
        t = torch.tensor([self.d, k])
        return {"tokens": t, "labels": t}


def _reference_order(weights: np.ndarray, n: int) -> list[int]:
    """The blend rule written directly: the dataset furthest behind its share goes next."""
    counts = np.zeros(len(weights))
    order = []
    for i in range(n):
        d = int(np.argmax(weights * (i + 1) - counts))  # argmax takes the lowest d on ties
        counts[d] += 1
        order.append(d)
    return order


def test_blend_order_small_cases() -> None:
    assert blend_order([0.5, 0.5], 6).tolist() == [0, 1, 0, 1, 0, 1]
    assert blend_order([0.75, 0.25], 8).tolist() == [0, 0, 1, 0, 0, 0, 1, 0]
    assert blend_order([1.0], 3).tolist() == [0, 0, 0]


@pytest.mark.parametrize("seed", range(6))
def test_every_prefix_tracks_the_weights(seed: int) -> None:
    rng = np.random.default_rng(seed)
    d = int(rng.integers(2, 6))
    weights = rng.random(d) ** 2 + 0.01
    weights /= weights.sum()
    n = 2000
    order = blend_order(weights.tolist(), n)
    assert order.tolist() == _reference_order(weights, n)
    counts = np.cumsum(np.eye(d)[order], axis=0)  # [n, d]: samples from each in each prefix
    ideal = np.outer(np.arange(1, n + 1), weights)  # [n, d]
    # Before sample i the lags w_d*(i+1) - count_d sum to 1, so the largest, the one chosen,
    # is > 0: no count ever gets a whole sample ahead of its share. After it the lags sum to
    # 0, so with each above -1 none is d - 1 or more behind.
    assert (counts - ideal).max() < 1
    assert (ideal - counts).max() < d - 1


def test_blended_samples_and_reuse_in_new_orders() -> None:
    blend = BlendedDataset([(3.0, _Labelled(0, 100)), (1.0, _Labelled(1, 3))], 40, seed=7)
    assert blend.weights == [0.75, 0.25]
    got = [tuple(blend[i]["tokens"].tolist()) for i in range(len(blend))]
    assert [d for d, _ in got] == blend.dataset_index.tolist()
    assert [k for d, k in got if d == 0] == list(range(30))  # in order, no reuse
    small = [k for d, k in got if d == 1]  # 10 draws from 3 samples: 0,1,2 then new orders
    assert small[:3] == [0, 1, 2]
    passes = [small[3:6], small[6:9]]
    assert all(sorted(p) == [0, 1, 2] for p in passes)
    again = BlendedDataset([(3.0, _Labelled(0, 100)), (1.0, _Labelled(1, 3))], 40, seed=7)
    assert [tuple(again[i]["tokens"].tolist()) for i in range(40)] == got


@pytest.mark.parametrize(
    ("datasets", "num_samples", "message"),
    [
        ([], 10, r"a blend needs at least one \(weight, dataset\) pair"),
        ([(1.0, _Labelled(0, 5)), (-1.0, _Labelled(1, 5))], 10, r"weight 1 \(-1\.0\) must be"),
        ([(1.0, _Labelled(0, 5)), (float("nan"), _Labelled(1, 5))], 10, r"weight 1 \(nan\)"),
        ([(1.0, _Labelled(0, 0))], 10, r"dataset 0 of the blend \(weight 1\.0\) has no samples"),
        ([(1.0, _Labelled(0, 5))], -1, r"num_samples \(-1\) must be a non-negative integer"),
    ],
)
def test_bad_blend_raises_one_sentence(
    datasets: list[tuple[float, _Labelled]], num_samples: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as info:
        BlendedDataset(datasets, num_samples, seed=0)
    assert "\n" not in str(info.value)
