"""The dp sampler: ranks read disjoint slices that cover each batch; resuming at N is exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mega_pretrain.data import (
    DistributedBatchSampler,
    GPTDataset,
    IndexedTokenDataset,
    IndexedTokenWriter,
)


def _all_ranks(
    total: int, consumed: int, mbs: int, dp: int, drop_last: bool = True
) -> list[list[list[int]]]:
    return [
        list(DistributedBatchSampler(total, consumed, mbs, rank, dp, drop_last=drop_last))
        for rank in range(dp)
    ]


def test_docstring_example() -> None:
    assert list(DistributedBatchSampler(8, 0, 2, 1, 2)) == [[2, 3], [6, 7]]


@pytest.mark.parametrize(("total", "mbs", "dp"), [(50, 3, 4), (24, 2, 3), (7, 1, 1), (64, 4, 2)])
def test_ranks_are_disjoint_and_cover_each_batch(total: int, mbs: int, dp: int) -> None:
    per_rank = _all_ranks(total, 0, mbs, dp)
    steps = total // (mbs * dp)
    assert all(len(batches) == steps for batches in per_rank)
    for step in range(steps):
        together = [i for rank in range(dp) for i in per_rank[rank][step]]
        assert together == list(range(step * mbs * dp, (step + 1) * mbs * dp))
        assert all(len(per_rank[rank][step]) == mbs for rank in range(dp))
    for rank in range(dp):
        sampler = DistributedBatchSampler(total, 0, mbs, rank, dp)
        assert len(sampler) == steps
        list(sampler)
        assert sampler.state_dict() == {"consumed_samples": steps * mbs * dp}


def test_last_partial_batch() -> None:
    # 50 samples, batches of 12: four full batches, then [48, 49]
    assert [len(b) for b in _all_ranks(50, 0, 3, 4)] == [4, 4, 4, 4]
    kept = _all_ranks(50, 0, 3, 4, drop_last=False)
    assert [b[4:] for b in kept] == [[[48, 49]], [], [], []]
    lengths = [len(DistributedBatchSampler(50, 0, 3, r, 4, drop_last=False)) for r in range(4)]
    assert lengths == [5, 4, 4, 4]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_resume_at_consumed_continues_exactly(dp: int) -> None:
    total, mbs = 96, 2
    for rank in range(dp):
        straight = list(DistributedBatchSampler(total, 0, mbs, rank, dp))
        for steps_done in range(len(straight) + 1):
            consumed = steps_done * mbs * dp
            resumed = list(DistributedBatchSampler(total, consumed, mbs, rank, dp))
            assert resumed == straight[steps_done:]
        # the same through state_dict, taken in the middle of an iteration
        sampler = DistributedBatchSampler(total, 0, mbs, rank, dp)
        it = iter(sampler)
        first = [next(it) for _ in range(5)]
        state = sampler.state_dict()
        fresh = DistributedBatchSampler(total, 0, mbs, rank, dp)
        fresh.load_state_dict(state)
        assert first + list(fresh) == straight


def test_tp_and_cp_ranks_of_one_replica_read_the_same_samples() -> None:
    # with tp=2, cp=2, dp=2 the four ranks of replica 1 all have dp_rank 1
    replica = [list(DistributedBatchSampler(40, 8, 2, dp_rank=1, dp_size=2)) for _ in range(4)]
    assert all(r == replica[0] for r in replica)


def test_data_loader_resume_reads_the_same_tokens(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    with IndexedTokenWriter(tmp_path / "c", 257, eod_id=256) as writer:
        for n in rng.integers(1, 200, 30):
            writer.add_document(np.append(rng.integers(0, 256, int(n)), 256))
    ds = GPTDataset(IndexedTokenDataset(tmp_path / "c"), 16, seed=9, num_samples=80)

    def batches(consumed: int, rank: int) -> list[torch.Tensor]:
        sampler = DistributedBatchSampler(len(ds), consumed, 4, rank, 2)
        loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler)
        return [b["tokens"] for b in loader]  # [4, 16] each

    for rank in range(2):
        straight = batches(0, rank)
        assert len(straight) == 10 and straight[0].shape == (4, 16)
        resumed = batches(24, rank)  # 3 micro-batches of 4 on 2 ranks consumed
        assert all(torch.equal(a, b) for a, b in zip(resumed, straight[3:], strict=True))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 0, 2, 2, 2), r"dp_rank \(2\) must be below dp_size \(2\)"),
        ((10, 12, 2, 0, 2), r"consumed_samples \(12\) is past total_samples \(10\)"),
        ((10, 0, 0, 0, 2), r"micro_batch_size \(0\) must be an integer >= 1"),
        ((10, -1, 2, 0, 2), r"consumed_samples \(-1\) must be an integer >= 0"),
        ((10, 0, 2, 0, 0), r"dp_size \(0\) must be an integer >= 1"),
    ],
)
def test_bad_sampler_arguments_raise_one_sentence(
    args: tuple[int, int, int, int, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message) as info:
        DistributedBatchSampler(*args)
    assert "\n" not in str(info.value)
