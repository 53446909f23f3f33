"""ZB-H1 through the trainer: ``parallel.pp_schedule = "zb-h1"`` trains the tiny GPT as one process.

Reuses the layout contract of ``test_gpt_training_layouts`` (3 AdamW steps; losses, gradient
norms and final weights against plain gradient accumulation on one process). The GPT's
column/row linears defer their weight gradients into the W passes, and so do its norms
and embedding. With dp 2 the DDP buckets of the deferred weights are
reduced in the last W. Bad schedule choices fail at config time, one sentence each.
"""

from __future__ import annotations

import pytest
from test_gpt_training_layouts import _check, _parallel

from mega_parallel_grid.testing import DistPool
from mega_pretrain.build import gpt_config
from mega_pretrain.config import load_config
from mega_pretrain.plan import Plan
from mega_pretrain.validate import check_config

LAYOUTS = [
    ({"pp": 2, "pp_schedule": "zb-h1"}, 1),
    ({"pp": 2, "pp_schedule": "zb-h1"}, 2),
    ({"tp": 2, "pp": 2, "sequence_parallel": True, "pp_schedule": "zb-h1"}, 1),
]


@pytest.mark.parametrize(("layout", "dp"), LAYOUTS, ids=lambda v: str(v))
def test_zb_h1_training_matches_single_process(
    dist_pool: DistPool, layout: dict[str, object], dp: int
) -> None:
    _check(dist_pool, layout, {}, dp)


def _deferred_weight_grads() -> int:
    """Weight gradients the W passes computed on this rank over the layout run's 3 steps."""
    from mega_tp_layers import WeightGradStore

    count = 0
    run = WeightGradStore.run

    def counted(self: WeightGradStore) -> None:
        nonlocal count
        count += len(self)
        run(self)

    WeightGradStore.run = counted  # type: ignore[method-assign]
    try:
        _parallel({"pp": 2, "pp_schedule": "zb-h1"}, {})
    finally:
        WeightGradStore.run = run  # type: ignore[method-assign]
    return count


def test_the_trainer_runs_the_linears_weight_gradients_in_w(dist_pool: DistPool) -> None:
    """Each of the 4 micro-batches x 3 steps defers its stage's qkv, proj, fc1, fc2 and two
    norms (x 4 layers per stage), on the first stage the embedding, on the last the final
    norm and the output head: W is not a no-op, and no weight keeps a fused backward."""
    counts = dist_pool.run(_deferred_weight_grads, 2)
    assert counts == [3 * 4 * (4 * 6 + 1), 3 * 4 * (4 * 6 + 2)], counts


def _plan(world: int, **parallel: object) -> Plan:
    overrides = [("train.global_batch_size", "8"), ("train.micro_batch_size", "1")]
    overrides += [(f"parallel.{k}", str(v)) for k, v in parallel.items()]
    config = load_config(None, overrides)
    return check_config(config, gpt_config(config), world)


def test_zb_h1_in_the_dry_run_plan() -> None:
    plan = _plan(2, pp=2, pp_schedule="zb-h1")  # 8 micro-batches on one dp rank
    assert plan.schedule_name.startswith("ZB-H1")
    assert plan.bubble_fraction == pytest.approx(1 / (3 * 8 + 1))
    assert _plan(2, pp=2).bubble_fraction == pytest.approx(1 / (8 + 1))  # 1F1B unchanged


BAD = {
    "zbv": ({"pp": 2, "vpp": 2, "pp_schedule": "zbv"}, "'zbv' has a pure order"),
    "interleaved without vpp": (
        {"pp": 2, "pp_schedule": "interleaved"},
        "'interleaved' with vpp None: 'interleaved' needs vpp > 1",
    ),
    "zb-h1 with vpp": ({"pp": 2, "vpp": 2, "pp_schedule": "zb-h1"}, "'zb-h1' with vpp 2"),
    "zb-h1 without pp": ({"pp": 1, "pp_schedule": "zb-h1"}, "'zb-h1' needs pp > 1"),
    "unknown": ({"pp": 2, "pp_schedule": "dualpipe"}, "must be one of"),
}
RECOMPUTE = "but train.recompute 'full' reruns that forward in backward"


def test_zb_h1_refuses_full_recompute() -> None:
    overrides = [("train.global_batch_size", "8"), ("train.micro_batch_size", "1")]
    overrides += [("parallel.pp", "2"), ("parallel.pp_schedule", "zb-h1")]
    config = load_config(None, [*overrides, ("train.recompute", "full")])
    with pytest.raises(ValueError, match=RECOMPUTE):
        check_config(config, gpt_config(config), 2)
    config = load_config(None, [*overrides, ("train.recompute", "selective")])
    check_config(config, gpt_config(config), 2)


@pytest.mark.parametrize("case", list(BAD), ids=str)
def test_bad_schedule_is_one_sentence(case: str) -> None:
    parallel, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        _plan(2, **parallel)
