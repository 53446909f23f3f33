"""DualPipeV's overlapped pairs through the trainer (``parallel.dualpipev_overlap``, issue #23).

The layout contracts of ``test_gpt_training_layouts`` and ``test_moe_training`` (3 AdamW
steps; losses, gradient norms and final weights against one process) at pp 2, vpp 2:
the tiny GPT with the overlap switched off (with it on, ``test_zb_training`` runs it), the
tiny Mixtral-style MoE with 4 micro-batches (8 in ``test_zb_training``), and with ep 2 over
dp 2, where each pair's forward issues its token all-to-alls asynchronously and runs the
other micro-batch's layer backwards under them. The trainer calls the GPT chunks' hook
once per pair of the order, 3 steps over.
"""

from __future__ import annotations

import pytest
import test_moe_training as moe
import torch
from test_gpt_training_layouts import STEPS, _check, _parallel

from mega_models.overlap import OverlappedStage
from mega_parallel_grid.testing import DistPool
from mega_pipeline import dualpipev_pairs

DUALPIPEV = {"pp": 2, "vpp": 2, "pp_schedule": "dualpipev"}
MOE = {**moe.MIXTRAL, "num_layers": 4}  # one layer per virtual stage


def test_dualpipev_with_the_overlap_off_trains_as_one_process(dist_pool: DistPool) -> None:
    _check(dist_pool, {**DUALPIPEV, "dualpipev_overlap": False}, {"num_layers": 4}, 1)


@pytest.mark.parametrize(
    ("layout", "dp"), [(DUALPIPEV, 1), ({**DUALPIPEV, "ep": 2}, 2)], ids=["ep1", "ep2-dp2"]
)
def test_overlapped_moe_trains_as_one_process(
    dist_pool: DistPool, layout: dict[str, object], dp: int
) -> None:
    """4 micro-batches of 1 per dp rank (= 2 pp, the fewest DualPipeV takes)."""
    moe._check(dist_pool, layout, MOE, dp, micro=1 if dp == 2 else moe.MICRO)


def _hook_calls() -> tuple[int, int]:
    """The GPT chunks' overlapped calls over the layout run's 3 steps, and this rank's pairs
    per step (4 micro-batches)."""
    calls = 0
    real = OverlappedStage.overlapped_forward_backward

    def counted(self: OverlappedStage, *args: object) -> object:
        nonlocal calls
        calls += 1
        return real(self, *args)  # type: ignore[arg-type]

    OverlappedStage.overlapped_forward_backward = counted  # type: ignore[assignment,method-assign]
    try:
        _parallel(DUALPIPEV, {})
    finally:
        OverlappedStage.overlapped_forward_backward = real  # type: ignore[method-assign]
    rank = torch.distributed.get_rank()  # pp rank: the world is one pipeline
    return calls, len(dualpipev_pairs(2, rank, 4))


def test_the_trainer_calls_the_hook_once_per_pair(dist_pool: DistPool) -> None:
    for calls, pairs in dist_pool.run(_hook_calls, 2):
        assert pairs > 0 and calls == STEPS * pairs, (calls, pairs)
