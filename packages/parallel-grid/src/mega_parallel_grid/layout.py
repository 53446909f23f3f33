"""Rank arithmetic: which global ranks form each parallel group. No processes, no tensors."""

from __future__ import annotations

from math import gcd, prod

from mega_parallel_grid.config import ParallelConfig

__all__ = ["DENSE_DIMS", "EXPERT_DIMS", "EXPERT_HSDP_DIMS", "HSDP_DIMS", "RankLayout"]

#: Dimensions of the dense (attention / MLP) layout: tp x cp x dp x pp.
DENSE_DIMS: tuple[str, ...] = ("tp", "cp", "dp", "pp")
#: The two factors of dp under HSDP (dp_shard varies fastest inside dp).
HSDP_DIMS: tuple[str, ...] = ("dp_shard", "dp_replicate")
#: Dimensions of the expert (MoE) layout: etp x ep x edp x pp, folded over the same ranks.
EXPERT_DIMS: tuple[str, ...] = ("etp", "ep", "edp", "pp")
#: The two factors of edp under HSDP (edp_shard varies fastest inside edp); see RankLayout.
EXPERT_HSDP_DIMS: tuple[str, ...] = ("edp_shard", "edp_replicate")

# Expert names stand in the ``order`` string at the place of their dense counterpart.
_EXPERT_SLOT = {"etp": "tp", "ep": "ep", "edp": "dp", "pp": "pp"}
# ... and edp's HSDP factors at the place of dp's.
_EXPERT_HSDP_SLOT = {"edp_shard": "dp_shard", "edp_replicate": "dp_replicate"}


def _orthogonal_groups(sizes: list[int], members: list[bool]) -> list[list[int]]:
    """Groups of ranks that differ only in the dimensions flagged in ``members``.

    ``sizes`` lists the dimensions fastest-first (rank = sum(coord_i * stride_i) with
    stride_0 = 1). Inside a group, ranks are sorted by the member coordinates (first one
    fastest); groups are sorted by the remaining coordinates (first one fastest).
    """
    strides = [prod(sizes[:i]) for i in range(len(sizes))]
    inner = [(s, st) for s, st, m in zip(sizes, strides, members, strict=True) if m]
    outer = [(s, st) for s, st, m in zip(sizes, strides, members, strict=True) if not m]

    def offsets(dims: list[tuple[int, int]]) -> list[int]:
        result = [0]
        for size, stride in dims:  # later dims vary slower: expand as the outer loop
            result = [base + i * stride for i in range(size) for base in result]
        return result

    return [[base + off for off in offsets(inner)] for base in offsets(outer)]


def _digits(rank: int, sizes: list[int]) -> list[int]:
    """Mixed-radix digits of ``rank``, fastest dimension first."""
    digits = []
    for size in sizes:
        digits.append(rank % size)
        rank //= size
    return digits


class RankLayout:
    """The parallel groups of a world of ``world_size`` ranks under ``config``.

    >>> layout = RankLayout(8, ParallelConfig(tp=2, pp=2))
    >>> layout.groups("tp")
    [[0, 1], [2, 3], [4, 5], [6, 7]]
    >>> layout.groups("pp")
    [[0, 4], [1, 5], [2, 6], [3, 7]]

    HSDP cuts dp into ``dp_shard`` (fastest) x ``dp_replicate``; a *replica* is the set of
    ranks with one ``dp_replicate`` coordinate, holding one sharded copy of the model. The
    experts' edp is cut the same way, ``edp = edp_shard + edp_replicate * layout.edp_shard``
    (edp_shard fastest), with ``layout.edp_replicate = gcd(edp, dp_replicate)``: when
    ep*etp divides tp*cp*dp_shard that is dp_replicate, and in the default order the expert
    shard group is the part of edp inside one replica (Megatron's expert groups within and
    across distributed-optimizer instances); when tp*cp*dp_shard divides ep*etp (a replica
    is too small to hold every expert) it is edp, each rank alone in its shard group.
    Either way every edp_shard group holds the same experts and meets its edp_replicate
    group in one rank.
    """

    def __init__(self, world_size: int, config: ParallelConfig) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size ({world_size!r}) must be a positive integer")
        c = config
        mp = c.tp * c.cp * c.pp
        if world_size % mp:
            raise ValueError(
                f"world size ({world_size}) is not divisible by tp*cp*pp "
                f"({c.tp}*{c.cp}*{c.pp} = {mp}); change the sizes or the number of ranks"
            )
        dense_replica = world_size // c.pp  # ranks of one pipeline stage: tp*cp*dp
        expert_inner = c.expert_tp * c.ep
        if dense_replica % expert_inner:
            raise ValueError(
                f"ep*etp ({c.ep}*{c.expert_tp} = {expert_inner}) does not divide tp*cp*dp "
                f"({dense_replica} ranks per pipeline stage); choose ep and etp whose product "
                f"divides {dense_replica}"
            )
        self.world_size = world_size
        self.config = config
        self.dp = world_size // mp
        self.dp_shard = self.dp if c.dp_shard is None else c.dp_shard
        if self.dp % self.dp_shard:
            raise ValueError(
                f"dp ({self.dp}) is not divisible by dp_shard ({self.dp_shard}); choose a "
                f"dp_shard that divides {self.dp}, or leave it unset to shard over all of dp"
            )
        self.dp_replicate = self.dp // self.dp_shard
        self.edp = dense_replica // expert_inner
        self.edp_replicate = gcd(self.edp, self.dp_replicate)
        self.edp_shard = self.edp // self.edp_replicate
        names = config.ordered_names
        if "dp" not in config.order.lower().split("-") and (self.dp > 1 or self.edp > 1):
            raise ValueError(
                f"order {config.order!r} leaves out dp, but {world_size} ranks give "
                f"dp = {self.dp} (expert dp = {self.edp}); add dp to the order"
            )
        self._names = names
        # the dense layout cuts dp into its two HSDP factors, dp_shard fastest
        self._dense_names = [m for n in names for m in (HSDP_DIMS if n == "dp" else (n,))]
        dense = {"tp": c.tp, "cp": c.cp, "ep": 1, "pp": c.pp}
        dense |= {"dp_shard": self.dp_shard, "dp_replicate": self.dp_replicate}
        expert = {"tp": c.expert_tp, "cp": 1, "ep": c.ep, "dp": self.edp, "pp": c.pp}
        self._dense_sizes = [dense[n] for n in self._dense_names]
        self._expert_sizes = [expert[n] for n in names]
        # the expert layout with edp cut into its two HSDP factors, edp_shard fastest
        self._expert_hsdp_names = [m for n in names for m in (HSDP_DIMS if n == "dp" else (n,))]
        expert |= {"dp_shard": self.edp_shard, "dp_replicate": self.edp_replicate}
        self._expert_hsdp_sizes = [expert[n] for n in self._expert_hsdp_names]
        if c.pp > 1 and _orthogonal_groups(
            self._dense_sizes, [n == "pp" for n in self._dense_names]
        ) != _orthogonal_groups(self._expert_sizes, [n == "pp" for n in names]):
            raise ValueError(
                f"with pp ({c.pp}) not last in order {config.order!r}, the expert layout "
                f"(etp={c.expert_tp}, ep={c.ep}, edp={self.edp}) puts pipeline stages on other "
                f"ranks than the dense layout (tp={c.tp}, cp={c.cp}, dp={self.dp}); put pp last "
                "in the order or make ep*etp equal tp*cp"
            )

    def sizes(self) -> dict[str, int]:
        """Size of every single dimension, dense and expert."""
        c = self.config
        return {
            "tp": c.tp, "cp": c.cp, "dp": self.dp, "pp": c.pp,
            "etp": c.expert_tp, "ep": c.ep, "edp": self.edp,
        }  # fmt: skip

    def _parse(self, dims: str) -> tuple[list[int], list[bool]]:
        tokens = dims.lower().split("-")
        known = set(DENSE_DIMS) | set(EXPERT_DIMS) | set(HSDP_DIMS) | set(EXPERT_HSDP_DIMS)
        for t in tokens:
            if t not in known:
                raise ValueError(
                    f"unknown dimension {t!r} in {dims!r}; use names from "
                    f"{', '.join(DENSE_DIMS + EXPERT_DIMS[:3] + HSDP_DIMS + EXPERT_HSDP_DIMS)} "
                    "joined by '-'"
                )
        if (
            len(set(tokens)) != len(tokens)
            or ("dp" in tokens and set(HSDP_DIMS) & set(tokens))
            or ("edp" in tokens and set(EXPERT_HSDP_DIMS) & set(tokens))
        ):
            raise ValueError(f"{dims!r} names a dimension twice; name each once")
        dense_only = {"tp", "cp", "dp", *HSDP_DIMS} & set(tokens)
        expert_only = {"etp", "ep", "edp", *EXPERT_HSDP_DIMS} & set(tokens)
        if dense_only and expert_only:
            raise ValueError(
                f"{dims!r} mixes dense ({', '.join(sorted(dense_only))}) and expert "
                f"({', '.join(sorted(expert_only))}) dimensions; the expert layout uses "
                "etp/ep/edp (and pp), the dense one tp/cp/dp (and pp)"
            )
        if expert_only:
            if set(EXPERT_HSDP_DIMS) & set(tokens):
                slots = {_EXPERT_HSDP_SLOT.get(t) or _EXPERT_SLOT[t] for t in tokens}
                return self._expert_hsdp_sizes, [n in slots for n in self._expert_hsdp_names]
            slots = {_EXPERT_SLOT[t] for t in tokens}
            return self._expert_sizes, [n in slots for n in self._names]
        wanted = set(tokens) | (set(HSDP_DIMS) if "dp" in tokens else set())
        return self._dense_sizes, [n in wanted for n in self._dense_names]

    def groups(self, dims: str) -> list[list[int]]:
        """All groups of one dimension or a hyphenated combination (``"tp"``, ``"dp-cp"``).

        ``"dp_shard"`` and ``"dp_replicate"`` (HSDP) are the two factors of dp and combine
        like the others (``"dp_shard-cp"``: the ZeRO shard group of a context-parallel run);
        ``"edp_shard"`` and ``"edp_replicate"`` are edp's (see the class doc).
        """
        sizes, members = self._parse(dims)
        return _orthogonal_groups(sizes, members)

    def group_of(self, dims: str, rank: int) -> list[int]:
        """The group of ``dims`` that holds ``rank``."""
        self._check_rank(rank)
        for group in self.groups(dims):
            if rank in group:
                return group
        raise AssertionError("every rank belongs to exactly one group")  # pragma: no cover

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index in every single dimension, dense and expert, and in dp's two
        HSDP factors (``dp = dp_shard + dp_replicate * layout.dp_shard``) and edp's
        (``edp = edp_shard + edp_replicate * layout.edp_shard``)."""
        self._check_rank(rank)
        dense = dict(zip(self._dense_names, _digits(rank, self._dense_sizes), strict=True))
        expert = dict(zip(self._names, _digits(rank, self._expert_sizes), strict=True))
        dp = dense["dp_shard"] + dense["dp_replicate"] * self.dp_shard
        return {
            "tp": dense["tp"], "cp": dense["cp"], "dp": dp, "pp": dense["pp"],
            "etp": expert["tp"], "ep": expert["ep"], "edp": expert["dp"],
            "dp_shard": dense["dp_shard"], "dp_replicate": dense["dp_replicate"],
            "edp_shard": expert["dp"] % self.edp_shard,
            "edp_replicate": expert["dp"] // self.edp_shard,
        }  # fmt: skip

    def embedding_ranks(self, rank: int) -> list[int]:
        """Ranks whose word-embedding copies ``rank`` keeps in sync (the embedding group).

        The first and last stage of ``rank``'s pipeline hold a copy (input embedding, tied
        output layer); a middle stage holds none, so its group is itself alone.
        """
        pipeline = self.group_of("pp", rank)
        ends = sorted({pipeline[0], pipeline[-1]})
        return ends if rank in ends else [rank]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank ({rank}) is outside the world of {self.world_size} ranks")

    def table(self) -> str:
        """One line per rank with its coordinates: the layout as a user reads it."""
        dims = [*DENSE_DIMS, "ep", "etp", "edp"]
        head = "rank " + " ".join(f"{d:>4}" for d in dims)
        rows = [head]
        for r in range(self.world_size):
            co = self.coords(r)
            rows.append(f"{r:>4} " + " ".join(f"{co[d]:>4}" for d in dims))
        return "\n".join(rows)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}={v}" for k, v in self.sizes().items())
        return f"RankLayout(world_size={self.world_size}, {sizes}, order={self.config.order!r})"
