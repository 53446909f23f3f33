"""``train.optimizer_kernel flat``: the trainer's AdamW through one flat kernel per shard run.

The tiny GPT cut to 2 layers, 3 AdamW steps of a global batch of 4 micro-batches (clipping
on), against the same run with torch's AdamW. On CPU the flat path runs the same elementwise
fp32 ops as torch's Adam on flat views; a vectorised loop and a scalar tail may round an op
differently (a fused multiply-add or not). So the fp32 masters may differ by the rounding
bound of ``assert_close_to_reference`` with ``n`` = the rounded ops chained into one value
(``OPS`` an optimizer step plus the forward and backward behind the next gradient, times
``STEPS``), scaled by the value's magnitude; the losses by the same bound with the loss as
the scale. A wrong hyperparameter, bias correction or piece moves a master by a fraction
of ``LR`` (3e-3) and the losses after it by far more. Checked at one process in fp32 and
bf16 (whose parameters the flat kernel writes itself) and at dp 2 under ZeRO-1 and ZeRO-3.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_pretrain.build import (
    build,
    flat_optimizer_kernel,
    gpt_config,
    parallel_config,
    param_dtype,
)
from mega_pretrain.config import TrainerConfig, load_config
from mega_pretrain.step import StepRunner
from mega_pretrain.validate import check_config

SEQ, MICRO, GLOBAL, STEPS, LR, LAYERS = 32, 2, 8, 3, 3e-3, 2
#: rounded ops chained into a master per step: the optimizer's ~10, a forward and backward
#: through 2 layers of width 64 (~4 x 64 sums) behind the next gradient
OPS = 10 + 4 * 64


def _config(kernel: str, precision: str, layout: dict[str, str]) -> TrainerConfig:
    pairs = {
        "model.num_layers": str(LAYERS), "train.seq_len": str(SEQ),
        "train.micro_batch_size": str(MICRO), "train.global_batch_size": str(GLOBAL),
        "train.precision": precision, "train.optimizer_kernel": kernel,
        "train.clip_grad": "0.5", "parallel.bucket_size": "1000", **layout,
    }  # fmt: skip
    return load_config(None, list(pairs.items()))


def _batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, 257, (GLOBAL, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return [
        (tokens[i : i + MICRO, :-1], tokens[i : i + MICRO, 1:]) for i in range(0, GLOBAL, MICRO)
    ]


def _run(
    kernel: str, precision: str, layout: dict[str, str]
) -> tuple[list[float], list[torch.Tensor], list[torch.Tensor]]:
    """Losses of STEPS steps and an evaluation, this rank's masters and parameters after."""
    config = _config(kernel, precision, layout)
    check_config(config, gpt_config(config), world_size=torch.distributed.get_world_size())
    groups = init_process_groups(parallel_config(config))
    built = build(config, groups, rank_device())
    assert (built.optimizer._flat is not None) == (kernel == "flat")  # the setting reached it
    runner = StepRunner(
        built, groups, seq_len=SEQ, micro_batch_size=MICRO,
        hidden_size=gpt_config(config).hidden_size, dtype=param_dtype(config),
        device=rank_device(), sequence_parallel=False,
    )  # fmt: skip
    dp, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()  # dp = world
    n = GLOBAL // (MICRO * dp)

    def mine(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return _batches(step)[rank * n : (rank + 1) * n]

    losses = [float(runner.train_step(mine(step), LR)[0]) for step in range(STEPS)]
    losses.append(float(runner.eval_step(mine(STEPS))))
    state = built.optimizer.state_dict()["params"]
    masters = [
        piece["master"].float().cpu() for name in sorted(state) for piece in state[name]["pieces"]
    ]
    # each parameter's values where this rank holds its master (all of it at dp 1)
    named = dict(built.ddp.module.named_parameters())  # the names the state keys
    params = [
        named[name].detach().flatten()[piece["start"] : piece["end"]].float().cpu()
        for name in sorted(state)
        for piece in state[name]["pieces"]
    ]
    return losses, masters, params


LAYOUTS = {
    "one-process-fp32": ("fp32", {}, 1),
    "one-process-bf16": ("bf16", {}, 1),
    "dp2-zero1-bf16": ("bf16", {"parallel.distributed_optimizer": "true"}, 2),
    "dp2-zero3-bf16": (
        "bf16",
        {"parallel.distributed_optimizer": "true", "parallel.sharding": "parameters"},
        2,
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flat_kernel_run_is_the_torch_run(dist_pool: DistPool, layout: str) -> None:
    precision, parallel, ranks = LAYOUTS[layout]
    torch_runs = dist_pool.run(_run, ranks, args=("torch", precision, parallel))
    flat_runs = dist_pool.run(_run, ranks, args=("flat", precision, parallel))
    for rank, ((want_losses, want_masters, _), (losses, masters, params)) in enumerate(
        zip(torch_runs, flat_runs, strict=True)
    ):
        for i, (got, want) in enumerate(zip(losses, want_losses, strict=True)):
            assert_close_to_reference(
                got, want, reduction_length=OPS * STEPS, name=f"rank {rank} loss {i}"
            )
        assert len(masters) == len(want_masters) and masters
        for i, (got_m, want_m) in enumerate(zip(masters, want_masters, strict=True)):
            assert_close_to_reference(
                got_m, want_m, reduction_length=OPS * STEPS, name=f"rank {rank} master {i}"
            )
        # the flat kernel writes the bf16 parameters itself: the masters rounded (ZeRO-3 keeps
        # no whole parameter between steps; mega-zero-optim's test_flat_adamw checks its shards)
        if precision == "bf16" and "zero3" not in layout:
            for i, (param, master) in enumerate(zip(params, masters, strict=True)):
                assert torch.equal(param, master.bfloat16().float()), f"rank {rank} param {i}"


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (
            [("train.optimizer_kernel", "flat"), ("parallel.distributed_optimizer", "true"),
             ("parallel.optimizer_offload", "true")],
            r"^train.optimizer_kernel 'flat' updates the shards on the device, but "
            r"parallel.optimizer_offload true updates them on the host; use optimizer_kernel "
            r"'torch' or turn the offload off$",
        ),
    ],
    ids=["offload"],
)  # fmt: skip
def test_optimizer_kernel_config_errors(overrides: list[tuple[str, str]], pattern: str) -> None:
    config = load_config(None, overrides)
    with pytest.raises(ValueError, match=pattern) as info:
        check_config(config, gpt_config(config), world_size=2)
    assert ". " not in str(info.value)  # one sentence


def test_optimizer_kernel_names_its_values() -> None:
    with pytest.raises(ValueError, match=r"^train.optimizer_kernel \('triton'\) must be one of "):
        load_config(None, [("train.optimizer_kernel", "triton")])


def test_optimizer_kernel_checked_when_built_in_python() -> None:
    """A config built in Python, past the parser, is refused by the run's checks."""
    config = load_config(None, [])
    bad = dataclasses.replace(
        config,
        train=dataclasses.replace(config.train, optimizer_kernel="triton"),  # type: ignore[arg-type]
    )
    with pytest.raises(
        ValueError, match=r"^train.optimizer_kernel \('triton'\) must be 'auto', 'torch' or 'flat'$"
    ):
        check_config(bad, gpt_config(bad), world_size=1)


@pytest.mark.parametrize(
    ("kernel", "device", "offload", "flat"),
    [("auto", "cuda", False, True), ("auto", "cuda", True, False), ("auto", "cpu", False, False),
     ("flat", "cpu", False, True), ("torch", "cuda", False, False)],
)  # fmt: skip
def test_auto_is_flat_on_cuda_without_offload(
    kernel: str, device: str, offload: bool, flat: bool
) -> None:
    assert flat_optimizer_kernel(kernel, torch.device(device), offload) is flat
