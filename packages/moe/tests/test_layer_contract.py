"""MoELayer on ep x etp ranks == the dense single-process reference (outputs, losses, grads).

For ep in {1, 2, 4}, etp in {1, 2}, both dispatchers and both expert implementations,
without token dropping: the output, the input gradient, the three router losses (summed
over ranks) and every parameter gradient equal a plain per-token loop over the full
weights. Tolerance: see _moe_harness (rtol=1e-5 plus atol=1e-5 * max|expected| of each
tensor, fp32 reordered sums).
"""

from __future__ import annotations

import pytest
from _moe_harness import run_case

from mega_moe import MoEConfig, RouterConfig
from mega_parallel_grid.testing import DistPool

ROUTER = RouterConfig(
    num_experts=8, top_k=2, aux_loss_coeff=0.1, seq_aux_loss_coeff=0.05, z_loss_coeff=0.01
)
LAYOUTS = [(ep, etp) for ep in (1, 2, 4) for etp in (1, 2)]
VARIANTS = [(d, x) for d in ("alltoall", "allgather") for x in ("grouped", "sequential")]


@pytest.mark.parametrize(("dispatcher", "experts"), VARIANTS)
@pytest.mark.parametrize(("ep", "etp"), LAYOUTS)
def test_layer_matches_dense_reference(
    dist_pool: DistPool, ep: int, etp: int, dispatcher: str, experts: str
) -> None:
    cfg = MoEConfig(
        router=ROUTER,
        ffn_hidden_size=32,
        dispatcher=dispatcher,
        experts=experts,  # type: ignore[arg-type]
        shared_ffn_size=16,
    )
    results = dist_pool.run(run_case, ep * etp, args=(cfg,), kwargs={"ep": ep, "etp": etp})
    assert all(r["dropped"] == 0 for r in results)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_uneven_token_counts_over_ep(dist_pool: DistPool, dispatcher: str) -> None:
    """Ranks with different numbers of tokens (replica i holds 4 + 2 i positions)."""
    cfg = MoEConfig(router=ROUTER, ffn_hidden_size=32, dispatcher=dispatcher)  # type: ignore[arg-type]
    dist_pool.run(run_case, 4, args=(cfg,), kwargs={"ep": 2, "etp": 2, "uneven": True})
