"""Sharded optimizer state: what one dp rank saves, and how any dp size loads it back.

A shard lists, for every parameter, the pieces this rank owns as ranges of the flattened
parameter, with the fp32 master values and the optimizer state of each piece. Ranges of the
parameter (not of a buffer) make the format independent of the dp size, the bucket size and
the buffer layout: a rank of another dp size copies what overlaps its own pieces out of the
shards of every old rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mega_zero_optim.shard_range import Range

__all__ = [
    "FORMAT",
    "assemble_piece",
    "check_shards",
    "group_entries",
    "piece_entry",
    "restore_groups",
    "saved_group_of",
]

#: Format tag of a shard; bumped when the layout of the dict changes.
FORMAT = "mega_zero_optim.sharded/1"


def check_shards(
    shards: Sequence[Mapping[str, Any]],
    *,
    optimizer_name: str,
    num_groups: int,
    shapes: Mapping[str, tuple[int, ...]],
) -> None:
    """Raise ValueError when ``shards`` were not saved from this model and optimizer kind."""
    if not shards:
        raise ValueError("no state dict given; pass the dict saved by state_dict() on each rank")
    for shard in shards:
        if not isinstance(shard, Mapping) or shard.get("format") != FORMAT:
            raise ValueError(
                f"this is not a DistributedOptimizer state dict (format "
                f"{shard.get('format') if isinstance(shard, Mapping) else type(shard).__name__!r}"
                f", expected {FORMAT!r}); pass what DistributedOptimizer.state_dict() returned"
            )
        if shard["optimizer"] != optimizer_name:
            raise ValueError(
                f"the state dict was saved from {shard['optimizer']} but this optimizer is "
                f"{optimizer_name}; load it into the same kind of optimizer"
            )
        if len(shard["param_groups"]) != num_groups:
            raise ValueError(
                f"the state dict has {len(shard['param_groups'])} parameter groups but the "
                f"optimizer has {num_groups}; build the optimizer with the same groups"
            )
        saved = shard["params"]
        missing = sorted(set(shapes) - set(saved))
        extra = sorted(set(saved) - set(shapes))
        if missing or extra:
            raise ValueError(
                f"the state dict is from a different model: this model's {missing[:3]} are "
                f"missing from it and its {extra[:3]} are not in this model; load a state "
                "dict saved from the same model"
            )
        for name, shape in shapes.items():
            if tuple(saved[name]["shape"]) != shape:
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(saved[name]['shape'])} in the state "
                    f"dict but {shape} in this model; load a state dict saved from the same model"
                )


def assemble_piece(
    shards: Sequence[Mapping[str, Any]], name: str, want: Range, device: torch.device
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The fp32 master values and optimizer state of elements ``want`` of parameter ``name``.

    Copies every overlap of ``want`` with the saved pieces of ``name`` in ``shards``; each
    element must be covered exactly once, else ValueError. State tensors of 0 dims (Adam's
    ``step``) are per-parameter scalars, taken as they are (on the device they were saved on).
    """
    master = torch.empty(want.size, dtype=torch.float32, device=device)
    state: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {"master": 0}
    for shard in shards:
        for piece in shard["params"][name]["pieces"]:
            common = Range(piece["start"], piece["end"]).intersect(want)
            if common is None:
                continue
            src = common.shift(piece["start"])
            dst = common.shift(want.start)
            master[dst.start : dst.end] = piece["master"][src.start : src.end]
            covered["master"] += common.size
            for key, value in piece["state"].items():
                if value.dim() == 0:
                    state.setdefault(key, value.detach().clone())
                    continue
                if key not in state:
                    state[key] = torch.zeros(want.size, dtype=value.dtype, device=device)
                    covered[key] = 0
                state[key][dst.start : dst.end] = value[src.start : src.end]
                covered[key] += common.size
    for key, count in covered.items():
        if count != want.size:
            raise ValueError(
                f"the state dict shards cover {count} of the {want.size} elements "
                f"[{want.start}, {want.end}) of {name!r} (in {key!r}); pass the shard saved by "
                "every dp rank, each once"
            )
    return master, state


def piece_entry(in_param: Range, master: torch.Tensor, state: Mapping[str, Any]) -> dict[str, Any]:
    """What a shard saves of one piece: its range of the flattened parameter, a copy of its
    master values and its optimizer state's tensors."""
    return {
        "start": in_param.start,
        "end": in_param.end,
        "master": master.detach().clone(),
        "state": {k: v for k, v in state.items() if isinstance(v, torch.Tensor)},
    }


def group_entries(
    param_groups: Sequence[Mapping[str, Any]], group_names: Sequence[Sequence[str]]
) -> list[dict[str, Any]]:
    """Each param group's hyperparameters with the names of its parameters (not the
    tensors), so a load finds a group by what it holds."""
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "param_names": list(names)}
        for g, names in zip(param_groups, group_names, strict=True)
    ]


def restore_groups(
    param_groups: Sequence[dict[str, Any]],
    group_names: Sequence[Sequence[str]],
    saved_groups: Sequence[Mapping[str, Any]],
) -> None:
    """Set each param group's hyperparameters from the saved group holding its parameters."""
    for i, group in enumerate(param_groups):
        saved = saved_groups[saved_group_of(group_names[i], saved_groups, i)]
        group.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})


def saved_group_of(
    names: Sequence[str], saved_groups: Sequence[Mapping[str, Any]], index: int
) -> int:
    """The saved parameter group holding ``names`` (a group's hyperparameters follow its
    parameters, not its position); the same position when no saved group holds them all,
    e.g. for a group of no parameters or a state resharded from another layout."""
    wanted = set(names)
    if wanted:
        for j, saved in enumerate(saved_groups):
            if wanted <= set(saved.get("param_names", ())):
                return j
    return index
