"""The parallel configuration: how many ways each dimension is cut."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DIMENSION_NAMES", "ParallelConfig"]

#: The five names an ``order`` string is made of.
DIMENSION_NAMES: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the parallel dimensions; ``dp`` is derived from the world size.

    Building one has no side effects; it only checks the sizes and the ``order`` string.
    Checks that need the world size live in :class:`~mega_parallel_grid.RankLayout`.
    """

    tp: int = 1
    """Tensor-parallel size: each weight matrix is split over this many ranks."""
    pp: int = 1
    """Pipeline-parallel size: the layers are split into this many stages."""
    cp: int = 1
    """Context-parallel size: the sequence is split over this many ranks inside attention."""
    ep: int = 1
    """Expert-parallel size: the experts of an MoE layer are split over this many ranks."""
    etp: int | None = None
    """Expert tensor-parallel size: each expert's weights are split this many ways (default: tp)."""
    vpp: int | None = None
    """Virtual pipeline chunks per pipeline rank (interleaved schedule); None means no interleaving."""
    order: str = "tp-cp-ep-dp-pp"
    """Rank order: the first name varies fastest across consecutive global ranks."""
    dp_shard: int | None = None
    """HSDP: the data-parallel ranks a ZeRO shard group spans (None: all of dp, plain ZeRO).

    dp splits into ``dp_shard`` x ``dp_replicate`` (= dp / dp_shard), dp_shard varying
    fastest inside dp: the shard groups are runs of consecutive dp ranks (Megatron's
    intra distributed-optimizer instance group; dp_replicate is its
    ``num_distributed_optimizer_instances``), the replicate groups stride across them.
    """

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{name} ({value!r}) must be a positive integer; use 1 to disable it"
                )
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ValueError(
                f"etp ({self.etp!r}) must be a positive integer, or None to use tp ({self.tp})"
            )
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or self.vpp < 1:
                raise ValueError(
                    f"vpp ({self.vpp!r}) must be a positive integer, or None for no interleaving"
                )
            if self.pp == 1:
                raise ValueError(
                    f"vpp ({self.vpp}) needs pipeline parallelism, but pp is 1; "
                    "set pp > 1 or leave vpp unset"
                )
        if self.dp_shard is not None and (
            isinstance(self.dp_shard, bool)
            or not isinstance(self.dp_shard, int)
            or self.dp_shard < 1
        ):
            raise ValueError(
                f"dp_shard ({self.dp_shard!r}) must be a positive integer, or None to shard "
                "over all of dp"
            )
        self._check_order()

    def _check_order(self) -> None:
        names = self.order.lower().split("-")
        for name in names:
            if name not in DIMENSION_NAMES:
                raise ValueError(
                    f"order {self.order!r} names an unknown dimension {name!r}; "
                    f"valid names are {', '.join(DIMENSION_NAMES)}"
                )
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"order {self.order!r} repeats {', '.join(repeated)}; name each dimension once"
            )
        sizes = {"tp": self.tp, "cp": self.cp, "ep": self.ep, "pp": self.pp}
        for name, size in sizes.items():
            if name not in names and size > 1:
                raise ValueError(
                    f"order {self.order!r} leaves out {name}, whose size is {size}; "
                    f"add {name} to the order"
                )

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size actually used (``etp``, or ``tp`` when unset)."""
        return self.tp if self.etp is None else self.etp

    @property
    def model_parallel_size(self) -> int:
        """Ranks one data-parallel replica of the dense model spans: tp * cp * pp."""
        return self.tp * self.cp * self.pp

    @property
    def ordered_names(self) -> tuple[str, ...]:
        """The five dimension names in rank order (names absent from ``order`` appended)."""
        names = self.order.lower().split("-")
        return tuple(names + [n for n in DIMENSION_NAMES if n not in names])
