"""This rank's torch process groups for every parallel dimension, built once per process."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mega_parallel_grid.config import ParallelConfig
from mega_parallel_grid.layout import RankLayout

__all__ = [
    "DEFAULT_TIMEOUT",
    "GROUP_DIMS",
    "Group",
    "ProcessGroups",
    "group_rank",
    "group_size",
    "init_process_groups",
]

#: A process group, or None for one rank (no torch.distributed needed).
Group = ProcessGroup | None


def group_size(group: Group) -> int:
    """Ranks in ``group`` (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's index in ``group`` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


#: Timeout of every collective on the groups unless the caller gives another.
DEFAULT_TIMEOUT = timedelta(minutes=10)

#: Field name of :class:`ProcessGroups` -> the hyphenated dimensions it spans.
GROUP_DIMS: dict[str, str] = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "cp": "cp",
    "ep": "ep",
    "etp": "etp",
    "edp": "edp",
    "dp_cp": "dp-cp",
    "tp_cp": "tp-cp",
    "tp_dp_cp": "tp-dp-cp",
    "mp": "tp-pp",
    "etp_ep": "etp-ep",
    "etp_ep_pp": "etp-ep-pp",
    "dp_shard": "dp_shard",
    "dp_replicate": "dp_replicate",
    "dp_shard_cp": "dp_shard-cp",
    "edp_shard": "edp_shard",
    "edp_replicate": "edp_replicate",
}


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's process groups, one per parallel dimension (see :data:`GROUP_DIMS`).

    ``embedding`` joins the first and last pipeline stage (tied input/output embedding);
    ``world`` is the default group. Pass the field a layer needs (``tp_group=groups.tp``).
    """

    tp: ProcessGroup
    pp: ProcessGroup
    dp: ProcessGroup
    cp: ProcessGroup
    ep: ProcessGroup
    etp: ProcessGroup
    edp: ProcessGroup
    dp_cp: ProcessGroup
    tp_cp: ProcessGroup
    tp_dp_cp: ProcessGroup
    mp: ProcessGroup
    etp_ep: ProcessGroup
    etp_ep_pp: ProcessGroup
    dp_shard: ProcessGroup
    """HSDP: the ranks a ZeRO shard group spans (all of dp unless ``dp_shard`` is set)."""
    dp_replicate: ProcessGroup
    """HSDP: the ranks holding the same shard (one rank unless ``dp_shard`` is set)."""
    dp_shard_cp: ProcessGroup
    """HSDP with context parallelism: the shard group times cp (``dp_cp`` without HSDP)."""
    edp_shard: ProcessGroup
    """HSDP: the ranks an expert shard group spans, inside edp (all of edp without HSDP)."""
    edp_replicate: ProcessGroup
    """HSDP: the ranks holding the same expert shard (one rank without HSDP)."""
    embedding: ProcessGroup
    world: ProcessGroup
    layout: RankLayout = field(repr=False)
    global_rank: int = 0

    def group(self, dim: str) -> ProcessGroup:
        """The group of a dimension, by field name (``"dp_cp"``) or hyphenated (``"dp-cp"``)."""
        name = dim.replace("-", "_")
        if name == "tp_pp":
            name = "mp"
        if name not in {f.name for f in fields(self)} - {"layout", "global_rank"}:
            known = ", ".join([*GROUP_DIMS, "embedding", "world"])
            raise ValueError(f"no process group named {dim!r}; known names: {known}")
        group: ProcessGroup = getattr(self, name)
        return group

    def rank(self, dim: str) -> int:
        """This process's rank inside the group of ``dim``."""
        return dist.get_rank(self.group(dim))

    def size(self, dim: str) -> int:
        """Number of ranks in the group of ``dim``."""
        return dist.get_world_size(self.group(dim))

    def device_mesh(self, device_type: str | None = None) -> dist.device_mesh.DeviceMesh:
        """A DeviceMesh view of the dense layout over the existing groups (no new groups).

        Mesh dimensions are named after the dense dimensions, slowest first
        (``("pp", "dp", "cp", "tp")`` for the default order), for DTensor and
        torch.distributed.checkpoint interop.
        """
        from torch.distributed.device_mesh import DeviceMesh

        layout = self.layout
        names = [n for n in reversed(layout.config.ordered_names) if n != "ep"]
        sizes = layout.sizes()
        mesh = torch.arange(layout.world_size).reshape([sizes[n] for n in names])
        if device_type is None:
            device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
        return DeviceMesh.from_group(
            [self.group(n) for n in names], device_type, mesh=mesh, mesh_dim_names=tuple(names)
        )


def _ensure_initialized(backend: str | None, timeout: timedelta) -> None:
    if dist.is_initialized():
        return
    missing = [
        v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"torch.distributed is not initialized and {', '.join(missing)} is not set; "
            "launch with torchrun or call torch.distributed.init_process_group first"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timeout)


def init_process_groups(
    config: ParallelConfig,
    backend: str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> ProcessGroups:
    """Build every process group of ``config`` and return this rank's.

    Initialises the default group from the torchrun environment when needed (NCCL when
    CUDA is available, gloo otherwise). Every rank creates the same groups in the same
    order; a group whose ranks equal an earlier one's is shared, not created twice.
    Collectives on the groups fail after ``timeout`` instead of hanging when a peer dies.
    """
    layout_probe_world = dist.get_world_size() if dist.is_initialized() else None
    if layout_probe_world is not None:
        RankLayout(layout_probe_world, config)  # validate before touching any group
    _ensure_initialized(backend, timeout)
    world_size = dist.get_world_size()
    layout = RankLayout(world_size, config)
    rank = dist.get_rank()
    pg_backend = backend if backend is not None else dist.get_backend()

    world = dist.group.WORLD
    assert world is not None
    made: dict[tuple[int, ...], object] = {tuple(range(world_size)): world}

    def mine(all_groups: list[list[int]]) -> ProcessGroup:
        found: ProcessGroup | None = None
        for ranks in all_groups:
            key = tuple(ranks)
            if key not in made:  # non-members get a placeholder; every rank still calls
                made[key] = dist.new_group(ranks, timeout=timeout, backend=pg_backend)
            if rank in ranks:
                group = made[key]
                assert isinstance(group, ProcessGroup)
                found = group
        assert found is not None
        return found

    mapping = {name: mine(layout.groups(dims)) for name, dims in GROUP_DIMS.items()}
    embedding_sets = sorted({tuple(layout.embedding_ranks(r)) for r in range(world_size)})
    mapping["embedding"] = mine([list(s) for s in embedding_sets])
    return ProcessGroups(**mapping, world=world, layout=layout, global_rank=rank)
