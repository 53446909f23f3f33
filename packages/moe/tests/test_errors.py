"""Bad input fails at construction (or at the call), in one sentence naming the values."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from mega_moe import GroupedMLP, MoEConfig, MoELayer, RouterConfig, SharedExpertMLP, TopKRouter
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool

H = 16


def _message(fn: Callable[[], object]) -> tuple[str, str]:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    return "none", "no error raised"


def _cfg(**router: Any) -> MoEConfig:
    return MoEConfig(
        router=RouterConfig(**{"num_experts": 8, "top_k": 2, **router}), ffn_hidden_size=32
    )


def _group_errors() -> dict[str, tuple[str, str]]:
    g = init_process_groups(ParallelConfig(tp=2, ep=2, etp=1))
    g_etp = init_process_groups(ParallelConfig(tp=1, ep=1, etp=2))
    layer = MoELayer(H, _cfg(), tp_group=g.tp)
    return {
        "experts_vs_ep": _message(
            lambda: MoELayer(
                H,
                MoEConfig(router=RouterConfig(num_experts=3, top_k=1), ffn_hidden_size=32),
                ep_group=g.ep,
            )
        ),
        "etp_vs_ffn": _message(
            lambda: MoELayer(
                H,
                MoEConfig(router=RouterConfig(num_experts=8, top_k=2), ffn_hidden_size=33),
                etp_group=g_etp.etp,
            )
        ),
        "shared_vs_tp": _message(
            lambda: MoELayer(
                H,
                MoEConfig(
                    router=RouterConfig(num_experts=8, top_k=2),
                    ffn_hidden_size=32,
                    shared_ffn_size=7,
                ),
                tp_group=g.tp,
            )
        ),
        "seq_vs_tp": _message(lambda: layer(torch.randn(5, 2, H))),
    }


EXPECTED_GROUP = {
    "experts_vs_ep": ("ValueError", "num_experts (3) is not divisible by ep (2)"),
    "etp_vs_ffn": ("ValueError", "ffn_hidden_size (33) is not divisible by etp (2)"),
    "shared_vs_tp": ("ValueError", "shared_ffn_size (7) is not divisible by tp (2)"),
    "seq_vs_tp": ("ValueError", "sequence length (5) is not divisible by tp (2)"),
}


def test_errors_that_need_groups(dist_pool: DistPool) -> None:
    for result in dist_pool.run(_group_errors, 2):
        for key, (kind, text) in EXPECTED_GROUP.items():
            got_kind, got = result[key]
            assert (got_kind, text in got, "\n" in got) == (kind, True, False), (key, got)


BAD_CONFIGS: dict[str, tuple[Callable[[], object], str]] = {
    "top_k > experts": (lambda: _cfg(top_k=9), "top_k (9) is larger than num_experts (8)"),
    "top_k 0": (lambda: _cfg(top_k=0), "top_k (0) must be a positive integer"),
    "score": (lambda: _cfg(score_function="relu"), "score_function ('relu') must be one of"),
    "groups half set": (lambda: _cfg(num_groups=4), "needs both num_groups (4) and group_topk"),
    "groups vs experts": (
        lambda: _cfg(num_groups=3, group_topk=1),
        "num_experts (8) is not divisible by num_groups (3)",
    ),
    "group_topk too big": (
        lambda: _cfg(num_groups=4, group_topk=3),
        "group_topk (3) must be at most num_groups (4) and top_k (2)",
    ),
    "groups too few experts": (
        lambda: _cfg(top_k=4, num_groups=8, group_topk=2),
        "top_k (4) exceeds the 2 experts of the best group_topk (2)",
    ),
    "capacity <= 0": (lambda: _cfg(capacity_factor=0.0), "capacity_factor (0.0) must be > 0"),
    "pad without capacity": (
        lambda: _cfg(pad_to_capacity=True),
        "pad_to_capacity=True needs a capacity_factor",
    ),
    "negative coeff": (lambda: _cfg(aux_loss_coeff=-1.0), "aux_loss_coeff (-1.0) must be >= 0"),
    "scaling": (lambda: _cfg(scaling_factor=0.0), "scaling_factor (0.0) must be > 0"),
    "drop policy": (lambda: _cfg(drop_policy="random"), "drop_policy ('random') must be one of"),
    "activation": (
        lambda: MoEConfig(router=RouterConfig(8, 2), ffn_hidden_size=8, activation="relu"),
        "activation ('relu') must be one of",
    ),  # type: ignore[arg-type]
    "dispatcher": (
        lambda: MoEConfig(router=RouterConfig(8, 2), ffn_hidden_size=8, dispatcher="p2p"),
        "dispatcher ('p2p') must be one of",
    ),  # type: ignore[arg-type]
    "pad with allgather": (
        lambda: MoEConfig(
            router=RouterConfig(8, 2, capacity_factor=1.0, pad_to_capacity=True),
            ffn_hidden_size=8,
            dispatcher="allgather",
        ),
        "pad_to_capacity works with the alltoall dispatcher, not 'allgather'",
    ),
    "gate without shared": (
        lambda: MoEConfig(router=RouterConfig(8, 2), ffn_hidden_size=8, shared_expert_gate=True),
        "need shared experts, but shared_ffn_size is 0",
    ),
    "router type": (
        lambda: MoEConfig(router=None, ffn_hidden_size=8),  # type: ignore[arg-type]
        "router must be a RouterConfig",
    ),
    "ffn size": (
        lambda: MoEConfig(router=RouterConfig(8, 2), ffn_hidden_size=0),
        "ffn_hidden_size (0) must be a positive integer",
    ),
    "group type": (
        lambda: MoELayer(H, _cfg(), ep_group="ep"),  # type: ignore[arg-type]
        "needs ep_group to be a torch.distributed ProcessGroup or None",
    ),
    "layer input": (
        lambda: MoELayer(H, _cfg())(torch.randn(4, H)),
        "MoELayer expects sequence-first input [s, b, 16], got shape (4, 16)",
    ),
    "router input": (
        lambda: TopKRouter(H, RouterConfig(8, 2))(torch.randn(4, 2, 8)),
        "TopKRouter expects [s, b, 16] or [tokens, 16] input",
    ),
    "gemm": (
        lambda: GroupedMLP(H, 32, 8, gemm="cutlass"),  # type: ignore[arg-type]
        "GroupedMLP gemm ('cutlass') must be",
    ),
    "shared activation": (
        lambda: SharedExpertMLP(H, 32, activation="relu"),  # type: ignore[arg-type]
        "SharedExpertMLP activation ('relu') must be one of 'swiglu', 'gelu'",
    ),
    "shared ffn size": (
        lambda: SharedExpertMLP(H, 0),
        "SharedExpertMLP ffn_hidden_size (0) must be a positive integer",
    ),
    "expert tokens": (
        lambda: GroupedMLP(H, 32, 2)(torch.randn(3, H), [1, 1]),
        "GroupedMLP got counts [1, 1] for 3 tokens and 2 local experts",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_input_raises_one_sentence(case: str) -> None:
    fn, text = BAD_CONFIGS[case]
    kind, message = _message(fn)
    assert kind in ("ValueError", "TypeError"), (case, message)
    assert text in message, message
    assert "\n" not in message
