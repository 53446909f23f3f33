"""``train.compile_mode``: the mode ``torch.compile`` gets for each layer, and where CUDA graphs apply.

``reduce-overhead`` makes Inductor record each compiled layer's forward and backward as CUDA
graphs (its cudagraph trees) and replay them, so a layer costs one graph launch instead of one
launch per kernel: the gain is the host's launch time, which dominates small models (``125m``)
and is hidden behind the GPU in large ones. A graph replays fixed shapes at fixed addresses, so
it applies only where every step feeds every layer the same shapes and nothing inside a layer
talks to another rank or the host:

- MoE layers route a different number of tokens to each expert every step (dropless grouped
  GEMMs of data-dependent sizes): refused;
- tensor, context and expert parallelism run collectives inside the layers: refused (their
  capture under cudagraph trees is not tested here);
- ZeRO-3 frees and re-gathers each layer's parameters every step: refused;
- the graphs need a GPU: refused on a machine without one.

``max-autotune-no-cudagraphs`` tunes Inductor's kernels without graphs and applies anywhere
``train.compile`` does. The step marks each new iteration for the graph trees
(``torch.compiler.cudagraph_mark_step_begin`` in :class:`~mega_pretrain.step.StepRunner`), so
the memory of the outputs a step's backward consumed is reused by the next step.
"""

from __future__ import annotations

from typing import Any

import torch

from mega_models import GPTConfig
from mega_pretrain.config import TrainerConfig

__all__ = ["COMPILE_MODES", "check_compile_mode", "compile_kwargs", "uses_cuda_graphs"]

#: ``train.compile_mode`` values: torch.compile's modes, less ``max-autotune`` (which is
#: ``max-autotune-no-cudagraphs`` plus the graphs of ``reduce-overhead``: pick them apart).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


def uses_cuda_graphs(config: TrainerConfig) -> bool:
    """Whether the layers replay as CUDA graphs (``train.compile`` with ``reduce-overhead``)."""
    return config.train.compile and config.train.compile_mode == "reduce-overhead"


def compile_kwargs(config: TrainerConfig) -> dict[str, Any]:
    """Keyword arguments of each layer's ``compile()`` call (none for the default mode)."""
    mode = config.train.compile_mode
    return {} if mode == "default" else {"mode": mode}


def check_compile_mode(
    config: TrainerConfig, model: GPTConfig, cuda_available: bool | None = None
) -> None:
    """Raise ValueError (one sentence naming the values) for a mode this run cannot use."""
    p, t = config.parallel, config.train
    mode = t.compile_mode
    if mode not in COMPILE_MODES:
        raise ValueError(f"train.compile_mode {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    if mode == "default":
        return
    if not t.compile:
        raise ValueError(
            f"train.compile_mode {mode!r} is a mode of torch.compile, which train.compile false "
            "turns off; set --train.compile true or drop the mode"
        )
    if mode != "reduce-overhead":
        return
    asked = "train.compile_mode 'reduce-overhead' (CUDA graphs)"
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if not cuda:
        raise ValueError(f"{asked} needs a GPU and none is visible; use the 'default' mode")
    if model.is_moe:
        raise ValueError(
            f"{asked} cannot replay MoE layers: each step routes a different number of tokens "
            f"to each of the {model.num_experts} experts (dynamic shapes); use the 'default' mode"
        )
    if p.zero_stage == "parameters":
        raise ValueError(
            f"{asked} replays fixed addresses, but parallel.sharding {p.sharding!r} (ZeRO-3) "
            "frees and re-gathers every layer's parameters each step; use the 'default' mode"
        )
    parallel = {"tp": p.tp, "cp": p.cp, "ep": p.ep}
    inside = {name: size for name, size in parallel.items() if size > 1}
    if inside:
        named = ", ".join(f"{name} {size}" for name, size in inside.items())
        raise ValueError(
            f"{asked} runs only where no collective is inside a layer, but {named} puts one "
            "there; use the 'default' mode or tp, cp and ep 1"
        )
