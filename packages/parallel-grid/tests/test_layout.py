"""RankLayout agrees with Megatron-LM's rank generator.

Two independent checks: the examples Megatron documents for its own generator, and a
brute-force definition of the same rule over a broad table of configurations (every rank's
coordinates by mixed-radix decomposition in ``order``, first name fastest; a group is the
set of ranks that agree on all other coordinates; groups and members in ascending order).
For the expert layout Megatron uses a second generator with tp := etp, cp := 1,
dp := world / (etp * ep * pp); the brute force does the same.
"""

from __future__ import annotations

import itertools
from math import prod

import pytest

from mega_parallel_grid import ParallelConfig, RankLayout

# -- Megatron's documented examples ---------------------------------------------------------


def test_megatron_docstring_16_gpus_tp2_pp4() -> None:
    # initialize_model_parallel's docstring: 16 GPUs, tp=2, pp=4 -> dp=2.
    layout = RankLayout(16, ParallelConfig(tp=2, pp=4))
    assert layout.groups("tp") == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
        [8, 9],
        [10, 11],
        [12, 13],
        [14, 15],
    ]
    assert layout.groups("dp") == [
        [0, 2],
        [1, 3],
        [4, 6],
        [5, 7],
        [8, 10],
        [9, 11],
        [12, 14],
        [13, 15],
    ]
    assert layout.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_megatron_docstring_context_parallel() -> None:
    # context_parallel_size's docstring: 8 GPUs, tp=4, cp=2 -> cp groups pair GPUs i, i+4.
    layout = RankLayout(8, ParallelConfig(tp=4, cp=2))
    assert layout.groups("cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_megatron_docstring_masked_groups_tp_dp_pp() -> None:
    # generate_masked_orthogonal_rank_groups' docstring: sizes [tp, dp, pp] = [2, 3, 4].
    layout = RankLayout(24, ParallelConfig(tp=2, pp=4, order="tp-dp-pp"))
    dp = layout.groups("dp")
    assert dp[0] == [0, 2, 4] and dp[1] == [1, 3, 5] and dp[7] == [19, 21, 23]
    assert len(dp) == 8


def test_style_guide_example() -> None:
    layout = RankLayout(world_size=8, config=ParallelConfig(tp=2, pp=2))
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]


# -- brute-force reference over a broad table -------------------------------------------------


def _reference(world: int, ordered: list[tuple[str, int]], tokens: set[str]) -> list[list[int]]:
    by_key: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world):
        rest, coords = rank, {}
        for name, size in ordered:
            coords[name] = rest % size
            rest //= size
        key = tuple(coords[n] for n, _ in ordered if n not in tokens)
        by_key.setdefault(key, []).append(rank)
    return sorted(sorted(g) for g in by_key.values())


def _table() -> list[tuple[int, ParallelConfig]]:
    rows: list[tuple[int, ParallelConfig]] = []
    orders = [
        "tp-cp-ep-dp-pp",
        "tp-dp-pp",
        "tp-pp-dp",
        "tp-cp-ep-pp-dp",
        "pp-dp-tp",
        "tp-cp-dp-pp-ep",
    ]
    for world in (1, 2, 4, 8, 12, 16, 64):
        for tp, cp, pp, ep, etp in itertools.product(
            (1, 2, 4), (1, 2), (1, 2, 4), (1, 2, 4), (None, 1, 2)
        ):
            for order in orders:
                if (cp > 1 and "cp" not in order) or (ep > 1 and "ep" not in order):
                    continue
                try:
                    config = ParallelConfig(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
                    RankLayout(world, config)
                except ValueError:
                    continue
                rows.append((world, config))
    return rows


TABLE = _table()


def test_table_is_broad() -> None:
    assert len(TABLE) > 500
    assert any(c.ep > 1 and c.cp > 1 and c.expert_tp != c.tp for _, c in TABLE)
    assert any(c.pp > 1 and c.order == "tp-pp-dp" for _, c in TABLE)


DENSE_QUERIES = [
    "tp",
    "cp",
    "dp",
    "pp",
    "dp-cp",
    "tp-cp",
    "tp-pp",
    "tp-dp-cp",
    "tp-dp",
    "cp-dp",
    "tp-cp-dp-pp",
]
EXPERT_QUERIES = ["ep", "etp", "edp", "etp-ep", "etp-ep-pp", "ep-edp", "pp"]


@pytest.mark.parametrize(
    ("world", "config"), TABLE, ids=lambda v: str(v) if isinstance(v, int) else ""
)
def test_layout_matches_reference(world: int, config: ParallelConfig) -> None:
    layout = RankLayout(world, config)
    names = list(config.ordered_names)
    dense = {"tp": config.tp, "cp": config.cp, "ep": 1, "dp": layout.dp, "pp": config.pp}
    expert = {"tp": config.expert_tp, "cp": 1, "ep": config.ep, "dp": layout.edp, "pp": config.pp}
    assert prod(dense.values()) == world == prod(expert.values())
    for query in DENSE_QUERIES:
        expected = _reference(world, [(n, dense[n]) for n in names], set(query.split("-")))
        assert layout.groups(query) == expected, query
    slot = {"etp": "tp", "ep": "ep", "edp": "dp", "pp": "pp"}
    for query in EXPERT_QUERIES:
        tokens = {slot[t] for t in query.split("-")}
        expected = _reference(world, [(n, expert[n]) for n in names], tokens)
        assert layout.groups(query) == expected, query
    # coordinates agree with group membership, and pp groups agree between the layouts
    for rank in range(world):
        co = layout.coords(rank)
        for dim in ("tp", "cp", "dp", "pp", "etp", "ep", "edp"):
            assert layout.group_of(dim, rank)[co[dim]] == rank
    assert layout.groups("pp") == _reference(world, [(n, expert[n]) for n in names], {"pp"})


def test_groups_partition_world_and_order_of_tokens_is_irrelevant() -> None:
    layout = RankLayout(16, ParallelConfig(tp=2, cp=2, pp=2))
    for dims in ("tp", "dp-cp", "tp-pp", "ep", "etp-ep"):
        flat = sorted(r for g in layout.groups(dims) for r in g)
        assert flat == list(range(16))
    assert layout.groups("dp-cp") == layout.groups("cp-dp")
    assert layout.embedding_ranks(5) == [5, 13]
    deep = RankLayout(8, ParallelConfig(pp=4, tp=2))
    assert deep.embedding_ranks(0) == [0, 6] and deep.embedding_ranks(6) == [0, 6]
    assert deep.embedding_ranks(2) == [2]  # a middle stage holds no embedding
    assert layout.sizes() == {"tp": 2, "cp": 2, "dp": 2, "pp": 2, "etp": 2, "ep": 1, "edp": 4}
    assert "rank" in layout.table().splitlines()[0]
    assert "world_size=16" in repr(layout)
