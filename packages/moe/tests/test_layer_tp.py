"""MoELayer inside a tensor-parallel layer (tp = 2), with and without sequence parallel.

Without SP the input is the same on every tp rank; the layer splits it over tp, routes
the slices, and all-gathers the output. With SP each rank routes its own slice. Either
way the result equals the dense reference on the whole sequence, the router losses are
taken over the whole sequence (the tp group is the sequence group), the router gradient
is complete on every tp rank, and the shared experts are tensor parallel. The expert
layout (ep, etp) folds over the same ranks. Tolerance: see _moe_harness.
"""

from __future__ import annotations

import pytest
from _moe_harness import run_case

from mega_moe import MoEConfig, RouterConfig
from mega_parallel_grid.testing import DistPool

ROUTER = RouterConfig(
    num_experts=8, top_k=2, aux_loss_coeff=0.1, seq_aux_loss_coeff=0.05, z_loss_coeff=0.01
)
# (ep, etp, world): the expert layout etp x ep x edp over tp x dp
LAYOUTS = [(1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 2, 4)]


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
@pytest.mark.parametrize(("ep", "etp", "world"), LAYOUTS)
def test_layer_under_tensor_parallel(
    dist_pool: DistPool, ep: int, etp: int, world: int, sp: bool
) -> None:
    dispatcher = "allgather" if (ep + etp + int(sp)) % 2 else "alltoall"
    cfg = MoEConfig(
        router=ROUTER,
        ffn_hidden_size=32,
        dispatcher=dispatcher,
        shared_ffn_size=16,
        shared_expert_gate=True,
    )
    dist_pool.run(run_case, world, args=(cfg,), kwargs={"ep": ep, "etp": etp, "tp": 2, "sp": sp})


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_global_aux_loss_over_tp_and_dp(dist_pool: DistPool, sp: bool) -> None:
    """The switch loss balanced over the tokens of all tp x dp ranks (counts all-reduced)."""
    cfg = MoEConfig(
        router=RouterConfig(num_experts=8, top_k=2, aux_loss_coeff=0.1), ffn_hidden_size=32
    )
    dist_pool.run(run_case, 4, args=(cfg,), kwargs={"ep": 2, "tp": 2, "sp": sp, "aux_global": True})
