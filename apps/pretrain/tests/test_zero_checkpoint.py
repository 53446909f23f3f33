"""Checkpoints across ZeRO stages: save under one ``parallel.sharding`` and dp, load under another.

The 4-layer tiny GPT of ``test_checkpoint`` trains 2 steps, saves, and runs step 2. Another
run (other seed, so other initial weights) of another stage or dp size loads the checkpoint:
its full weights (ZeRO-3's read inside ``gathered_parameters``) and its full optimizer
state (fp32 masters, both Adam moments and the step of every element, reassembled from
every dp rank's pieces) must equal the saved ones bitwise, and its step 2 must give the
original run's loss and weights to the contract tolerance (the new layout reorders float
sums; ``test_checkpoint`` gives the bound).
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mega_parallel_grid.testing import DistPool, assert_close_to_reference, sibling_module
from mega_pretrain.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from mega_pretrain.ckpt.async_save import AsyncSaver

_ckpt = sibling_module(__file__, "test_checkpoint")
MODEL, STEP_N, _merge, _Run = _ckpt.MODEL, _ckpt.STEP_N, _ckpt._merge, _ckpt._Run
Weights = dict[str, torch.Tensor]

#: per parameter name: the fields (master, exp_avg, exp_avg_sq, step) over all its elements
State = dict[str, dict[str, torch.Tensor]]


def _full_state(run: Any) -> State:
    """The optimizer state of every element, assembled from every rank's pieces, keyed by
    the chunk-independent path (the optimizer's names start with the chunk's index), in the
    dtypes it is kept in."""
    mine = run.built.optimizer.state_dict()["params"]
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    out: State = {}
    for shard in ranks:
        for name, entry in shard.items():
            numel = int(torch.Size(entry["shape"]).numel())
            fields = out.setdefault(re.sub(r"^(\d+\.)+", "", name), {})
            for piece in entry["pieces"]:
                values = {"master": piece["master"], **piece["state"]}
                for key, value in values.items():
                    if value.dim() == 0:  # Adam's step
                        fields.setdefault(key, value.clone())
                        continue
                    flat = fields.setdefault(
                        key, torch.full((numel,), float("nan"), dtype=value.dtype)
                    )
                    flat[piece["start"] : piece["end"]] = value.cpu()
    return out


def _weights(run: Any) -> Weights:
    with run.built.gathered_parameters():
        return run.full_weights()


def _save(run_dir: str, layout: dict[str, object]) -> tuple[Weights, State, float, Weights]:
    a = _Run({k: v for k, v in layout.items() if k != "async"}, MODEL)
    for step in range(2):
        a.step(step)
    saved, state = _weights(a), _full_state(a)
    if layout.get("async"):  # step 2 runs while the background write goes on
        saver = AsyncSaver(pin=False, timeout=timedelta(minutes=4))
        saver.save(Path(run_dir), 2, a.built, a.groups, a.state())
        loss = a.step(2)
        assert saver.wait() is not None
        saver.close()
    else:
        save_checkpoint(Path(run_dir), 2, a.built, a.groups, a.state())
        loss = a.step(2)
    return saved, state, loss, _weights(a)


def _load(run_dir: str, layout: dict[str, object]) -> tuple[Weights, State, float, Weights]:
    b = _Run(layout, MODEL, seed=99)
    path = latest_checkpoint(Path(run_dir))
    assert path is not None
    load_checkpoint(path, b.built, b.groups)
    loaded, state = _weights(b), _full_state(b)
    loss = b.step(2)
    return loaded, state, loss, _weights(b)


ZERO1 = {"sharding": "optimizer"}
ZERO2 = {"sharding": "gradients"}
ZERO3 = {"sharding": "parameters"}
CASES = [  # (saved at, world), [(loaded at, world), ...]
    ((ZERO3, 2), [(ZERO1, 2), (ZERO1, 1), (ZERO2, 2)]),
    (({**ZERO3, "async": True}, 2), [(ZERO1, 2)]),  # checkpoint.async_save's path
    (({**ZERO3, "dp_shard": 2}, 4), [(ZERO1, 2)]),  # HSDP: 2 shards x 2 replicas
    ((ZERO1, 2), [(ZERO3, 2)]),
    ((ZERO1, 1), [(ZERO3, 2)]),
    (({**ZERO1, "optimizer_offload": True}, 2), [(ZERO3, 2)]),  # host state saved, loaded on device
    ((ZERO1, 2), [({**ZERO3, "optimizer_offload": True}, 2)]),
]


@pytest.mark.parametrize(
    ("saved_at", "loaded_at"),
    CASES,
    ids=[
        "zero3-dp2-to-zero1-dp2-one-zero2-dp2",
        "zero3-dp2-async-to-zero1-dp2",
        "zero3-hsdp-2x2-to-zero1-dp2",
        "zero1-dp2-to-zero3-dp2",
        "one-to-zero3-dp2",
        "zero1-offload-dp2-to-zero3-dp2",
        "zero1-dp2-to-zero3-offload-dp2",
    ],
)
def test_checkpoints_reshard_between_zero_stages(
    dist_pool: DistPool,
    tmp_path: Path,
    saved_at: tuple[dict[str, object], int],
    loaded_at: list[tuple[dict[str, object], int]],
) -> None:
    _check(dist_pool, tmp_path, saved_at, loaded_at)


def _check(
    dist_pool: DistPool,
    tmp_path: Path,
    saved_at: tuple[dict[str, object], int],
    loaded_at: list[tuple[dict[str, object], int]],
) -> None:
    """Save at ``saved_at`` (layout, world); load at each of ``loaded_at`` and compare."""
    results = dist_pool.run(_save, saved_at[1], args=(str(tmp_path), saved_at[0]), timeout=300)
    saved, state, loss = _merge([r[0] for r in results]), results[0][1], results[0][2]
    after = _merge([r[3] for r in results])
    assert {r[2] for r in results} == {loss}
    assert all(torch.isfinite(v).all() for v in saved.values())
    for layout, world in loaded_at:
        out = dist_pool.run(_load, world, args=(str(tmp_path), layout), timeout=300)
        loaded = _merge([r[0] for r in out])
        assert loaded.keys() == saved.keys()
        for name, value in loaded.items():
            assert torch.equal(value, saved[name]), f"{name} differs after loading at {layout}"
        got = out[0][1]
        assert got.keys() == state.keys()
        for name, fields in got.items():
            assert fields.keys() == state[name].keys(), name
            for key, value in fields.items():
                assert torch.equal(value, state[name][key]), f"{name} {key} at {layout}"
        next_weights = _merge([r[3] for r in out])
        for _, _, next_loss, _ in out:
            assert_close_to_reference(next_loss, loss, reduction_length=STEP_N, name="loss")
        for name, value in next_weights.items():
            assert_close_to_reference(value, after[name], reduction_length=STEP_N, name=name)
