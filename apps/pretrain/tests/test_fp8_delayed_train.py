"""``train.fp8_amax_history``: delayed FP8 scaling in the trainer, checked against one process.

The tiny GPT cut to 2 layers, bf16 parameters and emulated fp8 on CPU (fp8 needs bf16, so
the layouts' fp32 contract cannot apply), 3 AdamW steps of a 4-sample global batch.

What is exact, and why: an amax is a max, which rounds nothing. Wherever a layout computes
the same tensors as one process bit for bit, its histories must equal one process's
exactly. Data parallelism does (each micro-batch runs the same forward and backward, and
the one-process run's losses and weights are bitwise those of dp 2): the histories must be
equal, element for element. So must a resumed run's, and every tp/cp rank's histories
with each other's (the update maxes them over tp x dp x cp).

What is not, and the bound: tensor and context parallelism reorder bf16 sums (row-parallel
partials, attention over sequence shards), so activations and gradients differ from one
process's by bf16 roundings (relative 2^-8 each), and a rounding that moves an element
across an fp8 rounding boundary moves that element by one fp8 step. The amax of a tensor
moves by no more than its elements do relative to the largest, so an input amax stays within
e4m3's relative rounding bound 2^-4 and a gradient amax within e5m2's 2^-3 of one
process's (measured: 3% and 5%). The losses are means over 128 tokens of quantities
perturbed the same way, with random signs: they stay within one bf16 unit, 2^-8 relative
(measured: 2e-4).

That bound holds where the layouts run the same weights, so the layout tests train at a
learning rate (``LAYOUT_LR``) at which the weights barely move. AdamW's first steps move
each weight by about ``lr`` whatever its gradient's size, in the gradient's sign; a
gradient element near zero whose sign a reordered sum flips moves its weight by ``2 lr``
the other way. At ``LR`` (3e-3, against weights of scale 0.02) that parts the layouts'
trajectories beyond any rounding bound within two steps (measured 2026-12-08: fc2's input
amax 8 % off one process's at cp 2 after two steps, 1 % before any). At ``LAYOUT_LR``
such a flip moves a weight by 1e-4 of that scale a step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch
from _reference_cache import reference_once

from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, rank_device
from mega_pretrain.build import build, gpt_config, parallel_config, param_dtype
from mega_pretrain.checkpoint import load_checkpoint
from mega_pretrain.config import TrainerConfig, load_config
from mega_pretrain.step import StepRunner
from mega_pretrain.train import train
from mega_pretrain.validate import check_config
from mega_tp_layers import ColumnParallelLinear, Fp8AmaxHistory, RowParallelLinear

SEQ, MICRO, GLOBAL, STEPS, HISTORY, LR = 32, 2, 4, 3, 4, 3e-3
LAYOUT_LR = 1e-6  # module doc: the layouts' weights stay within rounding of one process's
LAYERS = 2
Histories = dict[str, torch.Tensor]  # layer name -> [HISTORY, 2] (input, output gradient)
INPUT_BOUND, GRAD_BOUND, LOSS_BOUND = 2.0**-4, 2.0**-3, 2.0**-8  # module doc


def _config(
    history: int, fp8: bool = True, layout: dict[str, object] | None = None
) -> TrainerConfig:
    pairs: dict[str, object] = {
        "model.num_layers": LAYERS, "train.seq_len": SEQ, "train.micro_batch_size": MICRO,
        "train.global_batch_size": GLOBAL, "train.precision": "bf16", "train.fp8": fp8,
        "train.fp8_amax_history": history, "parallel.bucket_size": 1000,
    }  # fmt: skip
    pairs.update({f"parallel.{k}": v for k, v in (layout or {}).items()})
    return load_config(None, [(k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in pairs.items()])  # fmt: skip


def _histories(chunks: list[torch.nn.Module]) -> dict[str, Fp8AmaxHistory]:
    return {
        name: m
        for chunk in chunks
        for name, m in chunk.named_modules()
        if isinstance(m, Fp8AmaxHistory)
    }


def _snapshot(chunks: list[torch.nn.Module]) -> Histories:
    return {name: h.history.detach().clone().cpu() for name, h in _histories(chunks).items()}


class _Run:
    """One layout's model and step runner on this rank; steps on fixed global batches."""

    def __init__(
        self, history: int, fp8: bool = True, layout: dict[str, object] | None = None,
        lr: float = LR,
    ):  # fmt: skip
        self.lr = lr
        config = _config(history, fp8, layout)
        check_config(config, gpt_config(config), world_size=torch.distributed.get_world_size())
        self.groups = init_process_groups(parallel_config(config))
        dev = rank_device()
        self.built = build(config, self.groups, dev)
        self.runner = StepRunner(
            self.built, self.groups, seq_len=SEQ, micro_batch_size=MICRO,
            hidden_size=gpt_config(config).hidden_size, dtype=param_dtype(config), device=dev,
            sequence_parallel=config.parallel.sequence_parallel,
        )  # fmt: skip

    def step(self, step: int) -> float:
        """Train on the global batch of ``step`` (the same samples at every layout)."""
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, 257, (GLOBAL, SEQ + 1), generator=gen)
        batches = [
            (tokens[i : i + MICRO, :-1], tokens[i : i + MICRO, 1:]) for i in range(0, GLOBAL, MICRO)
        ]
        dp, dp_rank = self.groups.size("dp"), self.groups.rank("dp")
        return float(self.runner.train_step(batches[dp_rank::dp], self.lr)[0])

    @property
    def chunks(self) -> list[torch.nn.Module]:
        return list(self.built.chunks)


# 1. one process: the histories fill, and the delayed scales are used ------------------------


def _one_process(
    history: int, fp8: bool = True, lr: float = LR
) -> tuple[list[float], list[Histories], int]:
    """Losses, the histories after each step (before the first too), and the fp8 layers."""
    run = _Run(history, fp8, lr=lr)
    histories = _histories(run.chunks)
    assert all(not h.warm for h in histories.values())
    fp8_layers = sum(
        isinstance(m, ColumnParallelLinear | RowParallelLinear) and m.fp8 is not None
        for chunk in run.chunks
        for m in chunk.modules()
    )
    snapshots, losses = [_snapshot(run.chunks)], []
    for step in range(STEPS):
        losses.append(run.step(step))
        assert all(h.warm for h in histories.values())  # warm from the first update on
        assert all(not h.current.any() for h in histories.values())  # the running max restarts
        snapshots.append(_snapshot(run.chunks))
    return losses, snapshots, fp8_layers


def test_histories_fill_and_scale_the_later_steps(dist_pool: DistPool) -> None:
    delayed, snapshots, fp8_layers = reference_once(dist_pool, _one_process, HISTORY)
    current, current_snapshots, _ = reference_once(dist_pool, _one_process, 0)
    bf16, _, bf16_layers = reference_once(dist_pool, _one_process, 0, False)
    assert len(snapshots[0]) == fp8_layers == 4 * LAYERS and bf16_layers == 0
    assert current_snapshots[0] == {}  # amax_history 0: no histories
    for name, before in snapshots[0].items():
        assert not before.any(), name
        first, last = snapshots[1][name], snapshots[STEPS][name]
        assert (first[0] > 0).all() and not first[1:].any(), (name, first)
        assert (last[:STEPS] > 0).all() and not last[STEPS:].any(), (name, last)
        # each step pushes one row: the older rows are the last step's, shifted down
        for step in range(2, STEPS + 1):
            assert torch.equal(snapshots[step][name][1:], snapshots[step - 1][name][:-1]), name
    assert all(math.isfinite(x) for x in delayed) and delayed[-1] < delayed[0], delayed
    # the cold first step scales by the current amax, as amax_history 0 does: bit for bit;
    # from step 2 on the scales come from the history, and the rounding differs
    assert delayed[0] == current[0]
    assert all(d != c for d, c in zip(delayed[1:], current[1:], strict=True)), (delayed, current)
    # the fp8-vs-bf16 band of test_fp8_train.py (whose docstring derives it)
    torch.testing.assert_close(torch.tensor(delayed), torch.tensor(bf16), rtol=0.03, atol=0.0)


# 2. layouts: the same amaxes as one process --------------------------------------------------


def _parallel(layout: dict[str, object]) -> tuple[list[float], Histories]:
    run = _Run(HISTORY, layout=layout, lr=LAYOUT_LR)
    losses = [run.step(step) for step in range(STEPS)]
    return losses, _snapshot(run.chunks)


def _assert_within(actual: Histories, reference: Histories, what: str) -> None:
    """Every history within the rounding bounds of the module doc, column by column."""
    for name, ref in reference.items():
        got = actual[name]
        assert not got[STEPS:].any() and (got[:STEPS] > 0).all(), (what, name, got)
        ratio = got[:STEPS] / ref[:STEPS]
        for column, bound in ((0, INPUT_BOUND), (1, GRAD_BOUND)):
            worst = float((ratio[:, column] - 1).abs().max())
            assert worst <= bound, (
                f"{what}: {name} column {column} differs from one process's by {worst:.3g} "
                f"relative (bound {bound:.3g}): {got.tolist()} vs {ref.tolist()}"
            )


@pytest.mark.parametrize(
    "layout",
    [{"tp": 1}, {"tp": 2}, {"tp": 2, "sequence_parallel": True}, {"cp": 2}],
    ids=["dp2", "tp2", "tp2-sp", "cp2"],
)
def test_layouts_record_one_process_amaxes(dist_pool: DistPool, layout: dict[str, object]) -> None:
    ref_losses, snapshots, _ = reference_once(dist_pool, _one_process, HISTORY, True, LAYOUT_LR)
    reference = snapshots[STEPS]
    results = dist_pool.run(_parallel, 2, args=(layout,))
    first_losses, first = results[0]
    for losses, histories in results:  # every rank: the same global-batch loss and amaxes
        assert losses == first_losses
        assert set(histories) == set(reference)
        for name, value in histories.items():
            assert torch.equal(value, first[name]), (name, value, first[name])
    if layout == {"tp": 1}:  # dp 2: the same tensors as one process, so the same maxes
        assert first_losses == ref_losses
        for name, ref in reference.items():
            assert torch.equal(first[name], ref), (
                f"{name}: dp 2 recorded {first[name].tolist()}, one process {ref.tolist()}"
            )
        return
    torch.testing.assert_close(
        torch.tensor(first_losses), torch.tensor(ref_losses), rtol=LOSS_BOUND, atol=0.0
    )
    _assert_within(first, reference, str(layout))


# 3. resume: the histories come back, warm -----------------------------------------------------

COMMON = [
    ("model.num_layers", str(LAYERS)), ("train.steps", str(STEPS)), ("train.log_interval", "1"),
    ("train.seq_len", str(SEQ)), ("train.micro_batch_size", str(MICRO)),
    ("train.global_batch_size", str(GLOBAL)), ("train.eval_interval", "0"),
    ("train.precision", "bf16"), ("train.fp8", "true"), ("train.fp8_amax_history", str(HISTORY)),
    ("run.tensorboard", "false"), ("checkpoint.save_interval", "0"),
]  # fmt: skip


def _train(out_dir: str, name: str, extra: list[tuple[str, str]]) -> tuple[list[float], Histories]:
    """The trainer's run ``name``: its losses, and the histories of the checkpoint it ends with."""
    os.environ["MEGA_PRETRAIN_CACHE"] = str(Path(out_dir) / "cache")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = load_config(None, [*COMMON, ("run.out_dir", out_dir), ("run.name", name), *extra])
    summary = train(config)
    assert summary.checkpoint is not None
    groups = init_process_groups(parallel_config(config))
    built = build(config, groups, rank_device())
    load_checkpoint(summary.checkpoint, built, groups)
    histories = _histories(list(built.chunks))
    assert all(h.warm for h in histories.values())  # a loaded history scales the next step
    return summary.losses, _snapshot(list(built.chunks))


def _logged_losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def test_resume_continues_the_histories_exactly(dist_pool: DistPool, tmp_path: Path) -> None:
    out = str(tmp_path)
    straight, straight_histories = dist_pool.run(_train, 1, args=(out, "straight", []))[0]
    stopped, saved = dist_pool.run(
        _train, 1, args=(out, "resumed", [("train.exit_interval", "2")])
    )[0]
    assert len(stopped) == 2
    assert all(not h[2:].any() and (h[:2] > 0).all() for h in saved.values())  # 2 steps in
    resumed, histories = dist_pool.run(_train, 1, args=(out, "resumed", []))[0]
    assert len(resumed) == 1
    # bit-identical: a cold step 3 (history not restored, or not warm) scales otherwise
    assert _logged_losses(tmp_path / "resumed") == straight
    assert set(histories) == set(straight_histories)
    for name, value in histories.items():
        assert torch.equal(value, straight_histories[name]), name
        assert torch.equal(value[1:3], saved[name][:2]), name  # the saved rows, pushed on


def test_an_interval_records_every_kth_step_and_resumes_in_phase(
    dist_pool: DistPool, tmp_path: Path
) -> None:
    """train.fp8_amax_interval 2 over 3 steps: steps 0 and 2 record (two rows pushed), and
    a run stopped after step 0 resumes on the straight run's phase (its step 1 records
    nothing, as the straight run's did; a count restarted at the resume would record),
    bit for bit."""
    out, interval = str(tmp_path), [("train.fp8_amax_interval", "2")]
    straight, histories = dist_pool.run(_train, 1, args=(out, "straight", interval))[0]
    for name, h in histories.items():
        assert (h[:2] > 0).all() and not h[2:].any(), (name, h)
    stopped, _ = dist_pool.run(
        _train, 1, args=(out, "resumed", [*interval, ("train.exit_interval", "1")])
    )[0]
    assert len(stopped) == 1
    resumed, resumed_histories = dist_pool.run(_train, 1, args=(out, "resumed", interval))[0]
    assert len(resumed) == 2 and _logged_losses(tmp_path / "resumed") == straight
    for name, value in resumed_histories.items():
        assert torch.equal(value, histories[name]), name


def _overshoots(run_dir: Path) -> list[tuple[float, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    return [(r["fp8_overshoot_input"], r["fp8_overshoot_grad"]) for r in records]


def test_the_log_carries_each_step_overshoot(dist_pool: DistPool, tmp_path: Path) -> None:
    """With a log line every step: 0 on the cold first step (its scales were the current
    amaxes), then each step's largest amax over the one its scales used, positive and finite;
    with a margin the trainer runs and logs the same keys."""
    out = str(tmp_path)
    dist_pool.run(_train, 1, args=(out, "plain", []))
    dist_pool.run(_train, 1, args=(out, "margin", [("train.fp8_amax_margin", "1")]))
    for name in ("plain", "margin"):
        values = _overshoots(tmp_path / name)
        assert len(values) == STEPS and values[0] == (0.0, 0.0), (name, values)
        assert all(0 < v < 100 for step in values[1:] for v in step), (name, values)


# 4. configuration errors ----------------------------------------------------------------------

FP8 = [("train.fp8", "true"), ("train.precision", "bf16")]


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (
            [*FP8, ("train.fp8_amax_history", "-1")],
            r"^train.fp8_amax_history \(-1\) must be a non-negative integer: 0 for current "
            r"scaling, n > 0 for delayed scaling over the last n steps$",
        ),
        (
            [("train.fp8_amax_history", "4")],
            r"^train.fp8_amax_history \(4\) is delayed scaling, which needs train.fp8 true and "
            r"train.fp8_recipe tensor \(got fp8=false, recipe tensor\); set those or "
            r"train.fp8_amax_history 0$",
        ),
        (
            [*FP8, ("train.fp8_recipe", "row"), ("train.fp8_amax_history", "4")],
            r"^train.fp8_amax_history \(4\) is delayed scaling, which needs train.fp8 true and "
            r"train.fp8_recipe tensor \(got fp8=true, recipe row\); set those",
        ),
        (
            [*FP8, ("train.fp8_amax_history", "4"), ("parallel.tp", "2"),
             ("parallel.sequence_parallel", "true"), ("parallel.tp_comm_overlap", "true")],
            r"^train.fp8_amax_history \(4\) is not supported with parallel.tp_comm_overlap "
            r"true \(its rings scale by the current amax\); turn the overlap off or set "
            r"train.fp8_amax_history 0$",
        ),
        (
            [*FP8, ("train.fp8_amax_history", "4"), ("train.fp8_amax_margin", "9")],
            r"^train.fp8_amax_margin \(9\) must be an integer from 0 to 8: the delayed scales "
            r"leave 2\^margin of headroom above the history's amax$",
        ),
        (
            [*FP8, ("train.fp8_amax_margin", "1")],
            r"^train.fp8_amax_margin \(1\) gives delayed scaling headroom, but "
            r"train.fp8_amax_history is 0 \(current scaling never saturates\); set",
        ),
        (
            [*FP8, ("train.fp8_amax_history", "4"), ("train.fp8_amax_interval", "0")],
            r"^train.fp8_amax_interval \(0\) must be a positive integer: amaxes are recorded "
            r"every interval-th step \(1: every step\)$",
        ),
        (
            [*FP8, ("train.fp8_amax_interval", "8")],
            r"^train.fp8_amax_interval \(8\) spaces delayed scaling's recording, but "
            r"train.fp8_amax_history is 0; set",
        ),
    ],
    ids=["negative", "without-fp8", "row-recipe", "tp-comm-overlap", "margin-range",
         "margin-without-history", "interval-zero", "interval-without-history"],
)  # fmt: skip
def test_amax_history_config_errors(overrides: list[tuple[str, str]], pattern: str) -> None:
    config = load_config(None, overrides)
    with pytest.raises(ValueError, match=pattern) as info:
        check_config(config, gpt_config(config), world_size=2)
    assert ". " not in str(info.value)  # one sentence


@pytest.mark.parametrize("value", [1.5, True], ids=["float", "bool"])
def test_amax_history_must_be_an_int(value: object) -> None:
    """A config built in Python (the file and command-line parser refuse these first)."""
    config = load_config(None, FP8)
    config = dataclasses.replace(
        config, train=dataclasses.replace(config.train, fp8_amax_history=value)
    )
    with pytest.raises(ValueError, match=rf"^train.fp8_amax_history \({value!r}\) must be a "):
        check_config(config, gpt_config(config), world_size=1)


# 5. a skipped step ----------------------------------------------------------------------------


def _skipped_step() -> None:
    run = _Run(HISTORY)
    run.step(0)
    histories = _histories(run.chunks)
    before = _snapshot(run.chunks)
    chunk = run.built.chunks[0]
    norm = dict(chunk.named_parameters())["final_norm.weight"]
    with torch.no_grad():
        norm[0] = float("nan")  # every gradient non-finite: the optimizer refuses the step
    with pytest.raises(FloatingPointError, match=r"holds nan or inf"):
        run.step(1)
    assert all(h.current[0] > 0 for h in histories.values())  # the forwards recorded amaxes
    assert all(torch.equal(v, before[k]) for k, v in _snapshot(run.chunks).items())
    run.runner.discard_step()
    assert all(not h.current.any() for h in histories.values()), "current not zeroed"
    after = _snapshot(run.chunks)
    for name, value in after.items():
        assert torch.equal(value, before[name]), name  # untouched: no row pushed
    assert all(h.warm for h in histories.values())


def test_a_skipped_step_leaves_the_histories(dist_pool: DistPool) -> None:
    dist_pool.run(_skipped_step, 1)
