"""Buffer arithmetic: where each parameter lives, how buckets are cut, which range each rank owns.

Pure functions over integers; no tensors, no processes. A buffer holds the parameters of one
dtype packed end to end; it is cut into buckets (one collective each); every bucket is cut
into ``dp`` equal contiguous shards, and dp rank ``r`` owns shard ``r`` of every bucket.
A parameter may straddle buckets, and shards, so a rank may own several pieces of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Piece",
    "Range",
    "aligned_layout",
    "bucket_ranges",
    "owned_pieces",
    "pack",
    "padded_bucket_size",
    "shard_of",
]


@dataclass(frozen=True, order=True)
class Range:
    """The half-open element range ``[start, end)`` of a flat buffer or a flattened tensor."""

    start: int
    end: int

    def __post_init__(self) -> None:
        assert 0 <= self.start <= self.end, f"bad range [{self.start}, {self.end})"

    @property
    def size(self) -> int:
        """Number of elements in the range."""
        return self.end - self.start

    def intersect(self, other: Range) -> Range | None:
        """The common part of two ranges, or None when they do not overlap."""
        start, end = max(self.start, other.start), min(self.end, other.end)
        return Range(start, end) if start < end else None

    def shift(self, offset: int) -> Range:
        """The same range seen from ``offset`` (``offset`` becomes 0)."""
        return Range(self.start - offset, self.end - offset)


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``index`` that falls inside one owned shard."""

    index: int
    """Position of the parameter in the buffer's packing order."""
    in_buffer: Range
    """Where the piece lies in the flat buffer."""
    in_param: Range
    """Where the piece lies in the flattened parameter."""


def pack(numels: Sequence[int]) -> list[Range]:
    """Ranges of tensors of the given sizes laid end to end from 0, in the given order.

    >>> pack([3, 2, 4])
    [Range(start=0, end=3), Range(start=3, end=5), Range(start=5, end=9)]
    """
    ranges, offset = [], 0
    for n in numels:
        assert n >= 0
        ranges.append(Range(offset, offset + n))
        offset += n
    return ranges


def padded_bucket_size(bucket_size: int | None, numel: int, dp: int) -> int:
    """Elements per bucket: ``bucket_size`` (None: whole buffer) rounded up to a multiple of dp."""
    size = numel if bucket_size is None else bucket_size
    return max(dp, -(-size // dp) * dp)


def bucket_ranges(numel: int, bucket_size: int | None, dp: int) -> list[Range]:
    """Cut a buffer of ``numel`` packed elements into buckets that split evenly over ``dp`` ranks.

    Every bucket but the last holds :func:`padded_bucket_size` elements; the last one holds
    the rest, padded up to a multiple of ``dp``. The last range's end is the buffer size.

    >>> bucket_ranges(10, 4, 2)
    [Range(start=0, end=4), Range(start=4, end=8), Range(start=8, end=10)]
    >>> bucket_ranges(10, 4, 4)
    [Range(start=0, end=4), Range(start=4, end=8), Range(start=8, end=12)]
    """
    assert numel >= 0 and dp >= 1
    if numel == 0:
        return []
    size = padded_bucket_size(bucket_size, numel, dp)
    ranges = [Range(s, s + size) for s in range(0, numel, size)]
    last = ranges[-1]
    ranges[-1] = Range(last.start, last.start + -(-(numel - last.start) // dp) * dp)
    return ranges


def shard_of(bucket: Range, dp: int, rank: int) -> Range:
    """The contiguous part of ``bucket`` that dp rank ``rank`` owns (shard ``rank`` of ``dp``).

    >>> shard_of(Range(8, 16), 4, 1)
    Range(start=10, end=12)
    """
    assert bucket.size % dp == 0 and 0 <= rank < dp
    per_rank = bucket.size // dp
    start = bucket.start + rank * per_rank
    return Range(start, start + per_rank)


def owned_pieces(params: Sequence[Range], shard: Range) -> list[Piece]:
    """The pieces of the packed parameters ``params`` that lie inside ``shard``, in order.

    >>> owned_pieces(pack([3, 5]), Range(2, 6))
    [Piece(index=0, in_buffer=Range(start=2, end=3), in_param=Range(start=2, end=3)), \
Piece(index=1, in_buffer=Range(start=3, end=6), in_param=Range(start=0, end=3))]
    """
    pieces = []
    for index, where in enumerate(params):
        common = where.intersect(shard)
        if common is not None:
            pieces.append(Piece(index, common, common.shift(where.start)))
    return pieces


def aligned_layout(
    numels: Sequence[int], units: Sequence[int], bucket_size: int | None, dp: int
) -> tuple[list[Range], list[Range]]:
    """Pack tensors into buckets that end at tensor boundaries: (tensor ranges, bucket ranges).

    The layout of the gradient- and parameter-sharded stages, where each bucket owns its
    own storage (freed and re-allocated whole), so no tensor may straddle two buckets. A
    bucket closes once it holds ``bucket_size`` elements (None: never) or before the next
    tensor of another ``units`` id (a gather unit's buckets hold only its tensors); each
    bucket is padded to a multiple of ``dp``, so tensors keep straddling dp shards. A
    tensor larger than ``bucket_size`` gets a bucket of its own.

    >>> aligned_layout([3, 2, 4], [0, 0, 0], 4, 2)
    ([Range(start=0, end=3), Range(start=3, end=5), Range(start=6, end=10)], \
[Range(start=0, end=6), Range(start=6, end=10)])
    >>> aligned_layout([3, 2], [0, 1], None, 4)[1]
    [Range(start=0, end=4), Range(start=4, end=8)]
    """
    assert len(numels) == len(units) and dp >= 1
    tensors: list[Range] = []
    buckets: list[Range] = []
    start = offset = 0  # the open bucket begins at ``start``; the next tensor at ``offset``

    def close() -> None:
        nonlocal start, offset
        if offset > start:
            end = start + -(-(offset - start) // dp) * dp
            buckets.append(Range(start, end))
            start = offset = end

    for i, n in enumerate(numels):
        assert n >= 0
        if i > 0 and units[i] != units[i - 1]:
            close()
        tensors.append(Range(offset, offset + n))
        offset += n
        if bucket_size is not None and offset - start >= bucket_size:
            close()
    close()
    return tensors, buckets
