"""Split backward of the experts (B: input gradient, W: weight gradients later) == fused.

``GroupedMLP`` (``torch._grouped_mm`` and its loop) and ``SequentialMLP`` run their
backward fused and split (``_wgrad_testing.fused_and_split``) from the same weights,
tokens and output gradient, with host and device counts and an expert with no tokens.
The split W computes ``dy_l^T x_l`` per expert block as one grouped GEMM (or a loop), the
fused backward the same products in its kernels' order: every tensor agrees to the
rounding bound of ``assert_close_to_reference`` for the experts' chain of sums (H, FFN
forward and back, then the tokens of a weight gradient). A whole ``MoELayer`` at ep 2
splits its experts; the router's weight keeps its gradient in B.
"""

from __future__ import annotations

import pytest
import torch
from _wgrad_testing import SplitRun, fused_and_split
from torch import Tensor, nn

from mega_moe import GroupedMLP, MoEConfig, MoELayer, RouterConfig, SequentialMLP
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference

H, FFN, E = 16, 32, 4
COUNTS = [3, 0, 5, 2]  # an expert with no tokens still gets a (zero) gradient
M = sum(COUNTS)
N = 2 * (H + FFN) + M


def _close(run: SplitRun, n: int, what: str) -> None:
    assert torch.equal(run.split_out, run.fused_out), f"{what}: the forward changed"
    for name, fused in run.fused.items():
        assert_close_to_reference(run.split[name], fused, reduction_length=n, name=f"{what} {name}")


def _experts_run(mlp: nn.Module, counts: list[int] | Tensor) -> SplitRun:
    gen = torch.Generator().manual_seed(2)
    x0, dy = torch.randn(M, H, generator=gen), torch.randn(M, H, generator=gen)

    def forward() -> tuple[Tensor, dict[str, Tensor]]:
        x = x0.clone().requires_grad_()
        return mlp(x, counts), {"x": x}

    return fused_and_split(mlp, forward, dy)


@pytest.mark.parametrize("gemm", ["auto", "loop"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("device_counts", [False, True], ids=["host", "device"])
def test_grouped_mlp_split_equals_fused(gemm: str, activation: str, device_counts: bool) -> None:
    mlp = GroupedMLP(H, FFN, E, activation=activation, gemm=gemm, seed=0)  # type: ignore[arg-type]
    counts: list[int] | Tensor = torch.tensor(COUNTS) if device_counts else COUNTS
    run = _experts_run(mlp, counts)
    assert run.early == set() and run.deferred == 2, (run.early, run.deferred)
    _close(run, N, f"{gemm} {activation}")
    assert torch.count_nonzero(run.split["weight1"][1]) == 0  # expert 1 had no tokens


def test_grouped_mm_is_what_auto_runs_here() -> None:
    """The ``auto`` case above exercises the grouped GEMM where torch has its CPU kernel."""
    mlp = GroupedMLP(H, FFN, E, seed=0)
    assert mlp.uses_grouped_mm(torch.randn(M, H)) == (
        hasattr(torch, "_grouped_mm") and torch.__version__ >= "2.9"
    )


def test_sequential_mlp_split_equals_fused() -> None:
    mlp = SequentialMLP(H, FFN, E, seed=0)
    run = _experts_run(mlp, COUNTS)
    assert run.early == set() and run.deferred == 2 * E, (run.early, run.deferred)
    _close(run, N, "sequential")


S, B = 8, 2


def _check_moe_layer(ep: int, experts: str) -> None:
    groups = init_process_groups(ParallelConfig(ep=ep))
    cfg = MoEConfig(
        router=RouterConfig(num_experts=E, top_k=2, aux_loss_coeff=0.01), ffn_hidden_size=FFN,
        experts=experts,  # type: ignore[arg-type]
    )  # fmt: skip
    layer = MoELayer(H, cfg, ep_group=groups.ep, etp_group=groups.etp, tp_group=groups.tp,
                     seed=4, name="moe")  # fmt: skip
    gen = torch.Generator().manual_seed(7 + groups.rank("dp"))
    x0, dy = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)

    def forward() -> tuple[Tensor, dict[str, Tensor]]:
        x = x0.clone().requires_grad_()
        return layer(x), {"x": x}

    run = fused_and_split(layer, forward, dy)
    assert run.early == {"router.weight"}, run.early
    # n: the router's scores (H, then E), the experts' chain, the tokens of a weight grad
    _close(run, 2 * (H + E) + N + S * B * 2, f"ep {ep} {experts}")


@pytest.mark.parametrize("experts", ["grouped", "sequential"])
def test_moe_layer_split_equals_fused_at_ep2(dist_pool: DistPool, experts: str) -> None:
    dist_pool.run(_check_moe_layer, 2, (2, experts))
