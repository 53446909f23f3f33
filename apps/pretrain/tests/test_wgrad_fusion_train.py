"""``parallel.wgrad_into_main_grad``: the dense linears' weight gradients added into the fp32
``main_grad`` inside their backward (``mega_tp_layers.main_grad_fusion``) == through ``.grad``.

The tiny GPT cut to 2 layers, 3 AdamW steps of a global batch of 4 micro-batches, fp32, at
one process and at tp 2 with sequence parallel; the same run with the fusion off is the
reference. In fp32 the fused path adds ``dy^T x`` into the buffer inside the GEMM, the other
adds the product after it: the same sum up to the order of its roundings, so the losses and
the weights after the steps agree to the rounding bound of ``assert_close_to_reference``,
``n`` the rounded ops chained into one value (an optimizer step plus the forward and
backward behind the next gradient, times ``STEPS``, as in ``test_optimizer_kernel_train``).
The run checks the fusion took part: the block linears' weights carry the wrapper's offer
(the output head, whose weight the loss reads, and the norms do not).
"""

from __future__ import annotations

import pytest
import torch

from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_pretrain.build import build, gpt_config, parallel_config, param_dtype
from mega_pretrain.config import load_config
from mega_pretrain.step import StepRunner
from mega_tp_layers import MAIN_GRAD_ALPHA_ATTR

SEQ, MICRO, GLOBAL, STEPS, LR, LAYERS = 32, 2, 8, 3, 3e-3, 2
OPS = 10 + 4 * 64  # an optimizer step's ~10 ops, a forward and backward of width 64


def _run(fused: bool, layout: dict[str, str]) -> tuple[list[float], dict[str, torch.Tensor]]:
    pairs = {
        "model.num_layers": str(LAYERS), "train.seq_len": str(SEQ),
        "train.micro_batch_size": str(MICRO), "train.global_batch_size": str(GLOBAL),
        "train.precision": "fp32", "parallel.wgrad_into_main_grad": str(fused).lower(),
        **layout,
    }  # fmt: skip
    config = load_config(None, list(pairs.items()))
    groups = init_process_groups(parallel_config(config))
    built = build(config, groups, rank_device())
    offered = {
        name
        for name, p in built.ddp.module.named_parameters()
        if getattr(p, MAIN_GRAD_ALPHA_ATTR, None) is not None
    }
    linears = ("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight")
    want = {
        name for name, _ in built.ddp.module.named_parameters() if name.endswith(linears)
    }  # fmt: skip
    assert offered == (want if fused else set()), (sorted(offered), sorted(want))
    sp = layout.get("parallel.sequence_parallel") == "true"
    runner = StepRunner(
        built, groups, seq_len=SEQ, micro_batch_size=MICRO,
        hidden_size=gpt_config(config).hidden_size, dtype=param_dtype(config),
        device=rank_device(), sequence_parallel=sp,
    )  # fmt: skip
    losses = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 257, (GLOBAL, SEQ + 1), generator=gen)
        batches = [
            (tokens[i : i + MICRO, :-1], tokens[i : i + MICRO, 1:]) for i in range(0, GLOBAL, MICRO)
        ]
        losses.append(float(runner.train_step(batches, LR)[0]))
    weights = {n: p.detach().float().cpu().clone() for n, p in built.ddp.module.named_parameters()}
    return losses, weights


LAYOUTS = {
    "one-process": ({}, 1),
    "tp2-sp": ({"parallel.tp": "2", "parallel.sequence_parallel": "true"}, 2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_run_is_the_unfused_run(dist_pool: DistPool, layout: str) -> None:
    parallel, ranks = LAYOUTS[layout]
    plain = dist_pool.run(_run, ranks, args=(False, parallel))
    fused = dist_pool.run(_run, ranks, args=(True, parallel))
    for rank, ((want_losses, want_w), (losses, weights)) in enumerate(
        zip(plain, fused, strict=True)
    ):
        for i, (got, want) in enumerate(zip(losses, want_losses, strict=True)):
            assert_close_to_reference(
                got, want, reduction_length=OPS * STEPS, name=f"rank {rank} loss {i}"
            )
        assert set(weights) == set(want_w)
        for name, want in want_w.items():
            assert_close_to_reference(
                weights[name], want, reduction_length=OPS * STEPS, name=f"rank {rank} {name}"
            )
