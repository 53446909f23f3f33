"""Importing the model packages stays cheap: nothing imports dynamo until torch.compile runs
(it costs seconds on every ``--dry-run``, ``inspect`` and ``convert``); the attention core
that must run eagerly under torch.compile still does."""

from __future__ import annotations

import subprocess
import sys

import torch

from mega_models import GPTModel, model_config
from mega_parallel_grid.testing import DistPool, solo_groups

# every module of the packages below mega-pretrain, imported one after another
_IMPORT_ALL = """
import importlib, pkgutil, sys
for top in ("mega_parallel_grid", "mega_tp_layers", "mega_pipeline", "mega_zero_optim",
            "mega_moe", "mega_models"):
    package = importlib.import_module(top)
    for info in pkgutil.walk_packages(package.__path__, top + "."):
        importlib.import_module(info.name)
        assert "torch._dynamo" not in sys.modules, info.name
"""


def test_no_module_imports_dynamo() -> None:
    for code in ("import mega_models, sys; assert 'torch._dynamo' not in sys.modules",
                 _IMPORT_ALL):  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, done.stderr


def _compiled_dropout_recompute() -> None:
    from mega_tp_layers import tp_rng_tracker

    groups = solo_groups()
    config = model_config("tiny").replace(attention_dropout=0.1, hidden_dropout=0.0)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(7))
    grads = []
    for compiled in (False, True):
        torch.manual_seed(5)
        rng = tp_rng_tracker(99, groups.tp)
        model = GPTModel(config, groups, seed=3, recompute="selective", rng=rng)
        run = torch.compile(model, backend="eager") if compiled else model
        run(ids[:, :-1], ids[:, 1:]).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    # the compiled graph runs the same kernels in the same order: equal to the bit
    for eager, compiled_grad in zip(*grads, strict=True):
        assert eager is not None and compiled_grad is not None
        assert torch.equal(eager, compiled_grad)


def test_compiled_attention_replays_dropout_eagerly(dist_pool: DistPool) -> None:
    dist_pool.run(_compiled_dropout_recompute, 1)
