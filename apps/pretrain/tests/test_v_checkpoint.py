"""Checkpoints under the V pipeline schedules: save under ``zbv``/``dualpipev``, load elsewhere.

ZBV and DualPipeV (pp 2, vpp 2) build chunk 1 of pp rank ``r`` as virtual stage
``2 pp - 1 - r``, so rank 0 holds the first and the last layers and the interleaved
schedule's rank 0 holds other ones. The 4-layer tiny GPT of ``test_checkpoint`` (one layer
per virtual stage, untied: the V refuses a tied embedding) trains 2 steps, saves, and runs
step 2; a run of another seed at another layout loads the checkpoint: ``test_zero_checkpoint``'s
check, whose optimizer state is keyed by the chunk-independent path. Full weights and full
optimizer state (masters, both Adam moments, the step) equal the saved ones bitwise, and
step 2 gives the saving run's loss and weights to the contract tolerance
(``test_checkpoint`` gives the bound). DualPipeV's minimum of 2 pp micro-batches is met: 8
samples in micro-batches of 2 on one dp rank.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from mega_parallel_grid.testing import DistPool

_ZERO = "test_zero_checkpoint"  # its _sibling loads this folder's test modules by file
if _ZERO not in sys.modules:  # pytest imports them by file, not by name: load it once
    _spec = importlib.util.spec_from_file_location(_ZERO, Path(__file__).with_name(f"{_ZERO}.py"))
    assert _spec is not None and _spec.loader is not None
    sys.modules[_ZERO] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[_ZERO])
_zero = sys.modules[_ZERO]
Layout = tuple[dict[str, object], int]  # (parallel settings, world size)

ZBV = {"pp": 2, "vpp": 2, "pp_schedule": "zbv"}
DUALPIPEV = {"pp": 2, "vpp": 2, "pp_schedule": "dualpipev"}
INTERLEAVED = {"pp": 2, "vpp": 2}
ONE: dict[str, object] = {}
CASES = [  # (saved at, world), [(loaded at, world), ...]
    ((ZBV, 2), [(ONE, 1), (INTERLEAVED, 2)]),
    ((DUALPIPEV, 2), [(ONE, 1), (INTERLEAVED, 2)]),
    ((ONE, 1), [(ZBV, 2), (DUALPIPEV, 2)]),
    ((INTERLEAVED, 2), [(ZBV, 2)]),
]


@pytest.mark.parametrize(
    ("saved_at", "loaded_at"),
    CASES,
    ids=[
        "zbv-to-one-interleaved",
        "dualpipev-to-one-interleaved",
        "one-to-zbv-dualpipev",
        "interleaved-to-zbv",
    ],
)
def test_checkpoints_reshard_across_the_v(
    dist_pool: DistPool, tmp_path: Path, saved_at: Layout, loaded_at: list[Layout]
) -> None:
    _zero._check(dist_pool, tmp_path, saved_at, loaded_at)
