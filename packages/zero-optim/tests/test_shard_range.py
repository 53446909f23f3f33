"""Buffer arithmetic as pure functions: packing, bucket cuts, shards, owned pieces."""

from __future__ import annotations

import itertools

import pytest

from mega_zero_optim import Range, owned_pieces
from mega_zero_optim.shard_range import aligned_layout, bucket_ranges, pack, shard_of


def test_pack_lays_tensors_end_to_end() -> None:
    assert pack([3, 0, 2]) == [Range(0, 3), Range(3, 3), Range(3, 5)]
    assert pack([]) == []


def test_range_intersect_and_shift() -> None:
    assert Range(2, 6).intersect(Range(4, 9)) == Range(4, 6)
    assert Range(2, 4).intersect(Range(4, 9)) is None
    assert Range(5, 8).shift(5) == Range(0, 3)
    assert Range(5, 8).size == 3


def test_bucket_ranges_examples() -> None:
    assert bucket_ranges(10, 4, 2) == [Range(0, 4), Range(4, 8), Range(8, 10)]
    assert bucket_ranges(10, 3, 2) == [Range(0, 4), Range(4, 8), Range(8, 10)]  # 3 -> 4
    assert bucket_ranges(10, 4, 4) == [Range(0, 4), Range(4, 8), Range(8, 12)]  # last padded
    assert bucket_ranges(10, None, 4) == [Range(0, 12)]
    assert bucket_ranges(10, 100, 1) == [Range(0, 10)]
    assert bucket_ranges(0, 4, 2) == []


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8])
def test_bucket_ranges_properties(dp: int) -> None:
    for numel, size in itertools.product(range(1, 40), [None, 1, 2, 5, 7, 16, 64]):
        cuts = bucket_ranges(numel, size, dp)
        assert cuts[0].start == 0
        assert all(a.end == b.start for a, b in itertools.pairwise(cuts)), "contiguous"
        assert all(c.size % dp == 0 and c.size > 0 for c in cuts), "each splits over dp"
        assert numel <= cuts[-1].end < numel + dp, "covers the buffer, pads less than dp"
        assert len({c.size for c in cuts[:-1]}) <= 1, "equal buckets but the last"
        if size is not None:
            assert all(c.size >= size for c in cuts[:-1])


def test_shards_partition_each_bucket() -> None:
    bucket = Range(12, 24)
    shards = [shard_of(bucket, 4, r) for r in range(4)]
    assert shards == [Range(12, 15), Range(15, 18), Range(18, 21), Range(21, 24)]


def test_owned_pieces_example() -> None:
    params = pack([5, 4])  # [0, 5) and [5, 9)
    pieces = owned_pieces(params, Range(3, 7))
    assert [(p.index, p.in_buffer, p.in_param) for p in pieces] == [
        (0, Range(3, 5), Range(3, 5)),
        (1, Range(5, 7), Range(0, 2)),
    ]


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_size", [None, 1, 5, 13, 40])
def test_every_element_owned_exactly_once(dp: int, bucket_size: int | None) -> None:
    """Over all ranks and buckets, the pieces tile every parameter exactly once."""
    numels = [7, 1, 12, 30, 3]
    params = pack(numels)
    seen: dict[int, list[int]] = {i: [0] * n for i, n in enumerate(numels)}
    for bucket in bucket_ranges(params[-1].end, bucket_size, dp):
        for rank in range(dp):
            shard = shard_of(bucket, dp, rank)
            for piece in owned_pieces(params, shard):
                assert piece.in_buffer.size == piece.in_param.size
                assert piece.in_buffer.shift(params[piece.index].start) == piece.in_param
                for e in range(piece.in_param.start, piece.in_param.end):
                    seen[piece.index][e] += 1
    assert all(count == 1 for counts in seen.values() for count in counts)


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_size", [None, 1, 7, 40])
def test_aligned_layout_keeps_tensors_and_units_whole(dp: int, bucket_size: int | None) -> None:
    numels = [5, 12, 1, 9, 30, 2, 8]
    units = [0, 0, 1, 1, 1, 2, 2]
    tensors, buckets = aligned_layout(numels, units, bucket_size, dp)
    assert [t.size for t in tensors] == numels
    assert buckets[0].start == 0 and all(a.end == b.start for a, b in itertools.pairwise(buckets))
    for bucket in buckets:
        assert bucket.size % dp == 0
        inside = [i for i, t in enumerate(tensors) if t.intersect(bucket)]
        assert inside, "no empty bucket"
        assert all(
            bucket.start <= tensors[i].start and tensors[i].end <= bucket.end for i in inside
        )
        assert len({units[i] for i in inside}) == 1  # a bucket never mixes gather units
        if bucket_size is not None and len(inside) > 1:  # it closes once it is full
            assert tensors[inside[-2]].end - bucket.start < bucket_size
        assert bucket.end - tensors[inside[-1]].end < dp  # padding only to whole shards
