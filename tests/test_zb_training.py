"""The zero-bubble schedules through the trainer: ``parallel.pp_schedule`` ``zb-h1``, ``zbv``
and ``dualpipev`` train the tiny GPT (and, for the V schedules, the tiny MoE and a hybrid)
as one process.

Reuses the layout contracts of ``test_gpt_training_layouts`` and ``test_moe_training`` (3
AdamW steps; losses, gradient norms and final weights against plain gradient accumulation
on one process). The GPT's column/row linears defer their weight gradients into the W
passes, and so do its norms and embedding. With dp 2 the DDP buckets of the
deferred weights are reduced from the chunk's last W (overlap_grad_reduce): every bucket's
reduction has started before the optimizer waits for them. The V schedules (vpp 2: rank r
holds virtual stages r and 2 pp - 1 - r) run at pp 2. Bad schedule choices fail at config
time, one sentence each.
"""

from __future__ import annotations

import pytest
import test_moe_training as moe
import torch
from test_gpt_training_layouts import STEPS, _chain, _check, _parallel

from mega_parallel_grid.testing import DistPool, assert_close_to_reference
from mega_pretrain.build import gpt_config
from mega_pretrain.config import load_config
from mega_pretrain.plan import Plan
from mega_pretrain.validate import check_config

#: the layout suite's tiny GPT cut to 4 layers: one per virtual stage at pp 2 x vpp 2
GPT: dict[str, object] = {"num_layers": 4}
ZBV = {"pp": 2, "vpp": 2, "pp_schedule": "zbv"}
DUALPIPEV = {"pp": 2, "vpp": 2, "pp_schedule": "dualpipev"}
LAYOUTS = [
    ({"pp": 2, "pp_schedule": "zb-h1"}, 1),
    ({"pp": 2, "pp_schedule": "zb-h1"}, 2),
    ({"tp": 2, "pp": 2, "sequence_parallel": True, "pp_schedule": "zb-h1"}, 1),
    (ZBV, 1),
    (ZBV, 2),  # 2 micro-batches per dp rank; overlap_grad_reduce on (the default)
    ({**ZBV, "overlap_grad_reduce": False}, 2),
    ({**ZBV, "tp": 2, "sequence_parallel": True}, 1),
    (DUALPIPEV, 1),  # 4 micro-batches = 2 pp
]


@pytest.mark.parametrize(("layout", "dp"), LAYOUTS, ids=lambda v: str(v))
def test_zb_h1_training_matches_single_process(
    dist_pool: DistPool, layout: dict[str, object], dp: int
) -> None:
    _check(dist_pool, layout, GPT, dp)


@pytest.mark.parametrize("layout", [ZBV, DUALPIPEV], ids=["zbv", "dualpipev"])
def test_v_schedules_train_moe_as_one_process(
    dist_pool: DistPool, layout: dict[str, object]
) -> None:
    """Mixtral-style tiny MoE, 4 layers (one per virtual stage), 8 micro-batches of 1."""
    moe._check(dist_pool, layout, {**moe.MIXTRAL, "num_layers": 4}, 1, micro=1)


SHARED_EMBEDDING = [(ZBV, {"tie_embeddings": True}), (DUALPIPEV, {"mtp_num_layers": 1})]


@pytest.mark.parametrize(("layout", "model"), SHARED_EMBEDDING, ids=["zbv-tied", "dualpipev-mtp"])
def test_v_schedules_sum_the_end_chunks_embedding_grads(
    dist_pool: DistPool, layout: dict[str, object], model: dict[str, object]
) -> None:
    """The V puts the first and the last stage on pp rank 0: a tied embedding (or the one
    DeepSeek-V3's MTP depth reuses) has its two copies there, their gradients summed."""
    _check(dist_pool, layout, {**GPT, **model}, 1)


HYBRID = {"pattern": "M*-M*-M-"}  # the tiny GPT's sizes as a Mamba / attention / MLP hybrid


def test_zbv_trains_a_hybrid_as_one_process(dist_pool: DistPool) -> None:
    """The reference is the trainer on one process (the hybrid's own contract tests hold it
    to plain PyTorch); the V puts two layers on each virtual stage."""
    ref_losses, ref_norms, ref_weights = dist_pool.run(_parallel, 1, args=({}, HYBRID))[0]
    results = dist_pool.run(_parallel, 2, args=(ZBV, HYBRID))
    forward, grad = _chain(HYBRID)
    merged: dict[str, torch.Tensor] = {}
    for losses, norms, weights in results:
        assert_close_to_reference(
            torch.tensor(losses), torch.tensor(ref_losses), reduction_length=forward, name="losses"
        )
        assert_close_to_reference(
            torch.tensor(norms), torch.tensor(ref_norms), reduction_length=grad, name="grad norms"
        )
        merged.update(weights)
    assert set(merged) == set(ref_weights)
    for name, value in merged.items():
        assert_close_to_reference(
            value, ref_weights[name], reduction_length=STEPS * grad, name=name
        )


def _unlaunched_buckets() -> list[int]:
    """For each step, the gradient buckets whose reduction the hooks had not started when
    the optimizer came to wait for them (zbv, dp 2, overlap_grad_reduce on)."""
    from mega_zero_optim import DistributedDataParallel
    from mega_zero_optim.bucket import BucketState

    counts: list[int] = []
    finish = DistributedDataParallel.finish_grad_sync

    def counted(self: DistributedDataParallel) -> None:
        states = [b.state for b in self._buckets()]
        counts.append(sum(state is BucketState.ACCUMULATING for state in states))
        finish(self)

    DistributedDataParallel.finish_grad_sync = counted  # type: ignore[method-assign]
    try:
        _parallel(ZBV, {})
    finally:
        DistributedDataParallel.finish_grad_sync = finish  # type: ignore[method-assign]
    return counts


def test_zbv_reduces_gradients_from_the_last_w(dist_pool: DistPool) -> None:
    """The DDP hooks fire in the schedule: after each chunk's last W every bucket is on its way."""
    for counts in dist_pool.run(_unlaunched_buckets, 4):
        assert counts and set(counts) == {0}, counts


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


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_in_the_dry_run_plan(schedule: str) -> None:
    plan = _plan(2, pp=2, vpp=2, pp_schedule=schedule)  # 8 micro-batches, 12 chunk-units each
    assert plan.schedule_name.startswith({"zbv": "ZBV", "dualpipev": "DualPipeV"}[schedule])
    assert plan.bubble_fraction == pytest.approx(1 / (6 * 8 + 1))  # the last rank's wait
    assert plan.rank_layers == (4, 4)  # rank 0: stages 0 and 3, rank 1: stages 1 and 2


BAD = {
    "zbv without vpp": ({"pp": 2, "pp_schedule": "zbv"}, "'zbv' runs two chunks per rank in a V"),
    "dualpipev at vpp 4": (
        {"pp": 2, "vpp": 4, "pp_schedule": "dualpipev"},
        "'dualpipev' runs two chunks per rank in a V, but vpp is 4; set --parallel.vpp 2",
    ),
    "zbv without pp": (
        {"pp": 1, "vpp": 2, "pp_schedule": "zbv"},
        r"vpp \(2\) needs pipeline parallelism, but pp is 1",
    ),
    "interleaved without vpp": (
        {"pp": 2, "pp_schedule": "interleaved"},
        "'interleaved' with vpp None: 'interleaved' needs vpp > 1",
    ),
    "zb-h1 with vpp": ({"pp": 2, "vpp": 2, "pp_schedule": "zb-h1"}, "'zb-h1' with vpp 2"),
    "zb-h1 without pp": ({"pp": 1, "pp_schedule": "zb-h1"}, "'zb-h1' needs pp > 1"),
    "unknown": ({"pp": 2, "pp_schedule": "dualpipe"}, "must be one of"),
}
RECOMPUTE = "but train.recompute 'full' reruns that forward in backward"


def test_dualpipev_needs_two_pp_micro_batches() -> None:
    overrides = [("train.global_batch_size", "2"), ("train.micro_batch_size", "1")]
    overrides += [
        ("parallel.pp", "2"),
        ("parallel.vpp", "2"),
        ("parallel.pp_schedule", "dualpipev"),
    ]
    config = load_config(None, overrides)
    expected = r"'dualpipev' needs at least 2 \* pp \(4\) micro-batches per step, but there are 2"
    with pytest.raises(ValueError, match=expected):
        check_config(config, gpt_config(config), 2)


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "dualpipev"])
def test_split_schedules_refuse_full_recompute(schedule: str) -> None:
    overrides = [("train.global_batch_size", "8"), ("train.micro_batch_size", "1")]
    overrides += [("parallel.pp", "2"), ("parallel.pp_schedule", schedule)]
    if schedule != "zb-h1":
        overrides.append(("parallel.vpp", "2"))
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
