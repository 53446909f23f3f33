"""Split backward of the embedding and the FP8 / sequence-parallel linears == fused backward.

Each case runs one module's backward fused and split (``_wgrad_testing.fused_and_split``)
from the same weights, inputs and output gradient. The FP8 linears compute the same
quantised GEMMs in the same order either way (the W pass reuses the B pass's quantised
gradient and the forward's fp8 input, as the fused backward does), so their gradients
must be *equal*, at tp 1 and 2, with and without sequence parallel, and on the
high-precision fallback of unaligned shapes. The embedding's W runs the fused backward's
own ``embedding_dense_backward`` on the same (masked) output gradient: equal too. Under
sequence parallel the W
pass gathers the column layer's input again instead of keeping it: the gathers move from
B to W and their number stays the fused backward's.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tp_testing import recorded_dist_calls
from _wgrad_testing import fused_and_split
from torch import Tensor, nn

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool
from mega_tp_layers import (
    ColumnParallelLinear,
    Fp8Recipe,
    Normal,
    RowParallelLinear,
    VocabParallelEmbedding,
    defer_weight_grads,
    shard_tensor,
)

S, B, H, FFN, VOCAB = 8, 2, 32, 64, 50


class _Block(nn.Module):
    def __init__(self, g: dist.ProcessGroup, sp: bool, fp8: Fp8Recipe | None) -> None:
        super().__init__()
        kw = {"tp_group": g, "sequence_parallel": sp, "init_method": Normal(0.3), "seed": 3}
        self.fc1 = ColumnParallelLinear(H, FFN, fp8=fp8, name="fc1", **kw)  # type: ignore[arg-type]
        self.fc2 = RowParallelLinear(FFN, H, fp8=fp8, name="fc2", **kw)  # type: ignore[arg-type]
        with torch.no_grad():
            self.fc1.bias.normal_(generator=torch.Generator().manual_seed(5))  # type: ignore[union-attr]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _check_linears(tp: int, sp: bool, fp8: bool, seq: int) -> None:
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank = dist.get_rank(g)
    block = _Block(g, sp, Fp8Recipe(emulate=True) if fp8 else None)
    gen = torch.Generator().manual_seed(1)
    x_full, dy_full = torch.randn(seq, B, H, generator=gen), torch.randn(seq, B, H, generator=gen)
    x0 = shard_tensor(x_full, 0, rank, tp) if sp else x_full
    dy = shard_tensor(dy_full, 0, rank, tp) if sp else dy_full

    def forward() -> tuple[Tensor, dict[str, Tensor]]:
        x = x0.clone().requires_grad_()
        return block(x), {"x": x}

    with warnings.catch_warnings():  # the unaligned case warns that it runs in high precision
        warnings.simplefilter("ignore")
        run = fused_and_split(block, forward, dy)
    assert torch.equal(run.split_out, run.fused_out)
    row_bias = {"fc2.bias"} if tp > 1 else set()  # added after the reduction: no GEMM
    assert run.early == row_bias, run.early
    assert run.deferred == 2
    for name, fused in run.fused.items():
        assert torch.equal(run.split[name], fused), f"{name}: split != fused (tp {tp}, sp {sp})"


LINEAR_CASES = [(1, False, 16), (2, False, 16), (2, True, 16), (1, False, 5), (2, True, 6)]


@pytest.mark.parametrize(("tp", "sp", "seq"), LINEAR_CASES, ids=str)
def test_fp8_linears_split_equals_fused(dist_pool: DistPool, tp: int, sp: bool, seq: int) -> None:
    """16 tokens per GEMM run the fp8 GEMMs; 10 and 12 fall back to high precision."""
    dist_pool.run(_check_linears, tp, (tp, sp, True, seq))


def test_sequence_parallel_linears_split_equals_fused_at_tp4(dist_pool: DistPool) -> None:
    dist_pool.run(_check_linears, 4, (4, True, False, S))


def _gathers(tp: int) -> tuple[int, int, int]:
    """All-gathers of the SP block's backward: fused, then split's B and W."""
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    block = _Block(g, True, None)
    x = torch.randn(S // tp, B, H, requires_grad=True)
    gather = ["all_gather_into_tensor"]
    y = block(x)
    with recorded_dist_calls(gather, lambda n, kw: n) as fused:
        y.sum().backward()
    with defer_weight_grads() as store:
        y = block(x)
    with recorded_dist_calls(gather, lambda n, kw: n) as in_b:
        y.sum().backward()
    with recorded_dist_calls(gather, lambda n, kw: n) as in_w:
        store.run()
    return len(fused), len(in_b), len(in_w)


def test_sequence_parallel_w_gathers_the_input_again(dist_pool: DistPool) -> None:
    """The fused backward gathers the row layer's output gradient (the dual of its
    reduce-scatter) and the column layer's input for its wgrad; split, B gathers the
    first and W the second."""
    assert dist_pool.run(_gathers, 2, (2,)) == [(2, 1, 1)] * 2


def _check_embedding(tp: int, sp: bool) -> None:
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank = dist.get_rank(g)
    emb = VocabParallelEmbedding(VOCAB, H, tp_group=g, sequence_parallel=sp, seed=2, name="e")
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (S, B), generator=gen)
    ids[1:4, 0] = 7  # a row looked up several times: its gradient is a sum
    dy = torch.randn(S, B, H, generator=gen)
    if sp:
        dy = shard_tensor(dy, 0, rank, tp)

    def forward() -> tuple[Tensor, dict[str, Tensor]]:
        return emb(ids), {}

    run = fused_and_split(emb, forward, dy)
    assert torch.equal(run.split_out, run.fused_out)
    assert run.early == set() and run.deferred == 1, (run.early, run.deferred)
    assert torch.equal(run.split["weight"], run.fused["weight"]), "table grad: split != fused"
    assert bool(run.split["weight"].abs().sum() > 0) or tp > 1


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True)], ids=str)
def test_embedding_split_equals_fused(dist_pool: DistPool, tp: int, sp: bool) -> None:
    """The lookup's B has nothing to do; its W is the scatter-add of the output gradient."""
    dist_pool.run(_check_embedding, tp, (tp, sp))


def _check_data_input_and_frozen(tp: int, sp: bool, frozen: str) -> None:
    """Column -> GELU -> Row on an input that takes no gradient, or with a frozen layer."""
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank = dist.get_rank(g)
    block = _Block(g, sp, None)
    for name, p in block.named_parameters():
        p.requires_grad_(not name.startswith(frozen) if frozen else True)
    gen = torch.Generator().manual_seed(1)
    x_full, dy_full = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
    x0 = shard_tensor(x_full, 0, rank, tp) if sp else x_full
    dy = shard_tensor(dy_full, 0, rank, tp) if sp else dy_full

    def forward() -> tuple[Tensor, dict[str, Tensor]]:
        if frozen:  # the input takes a gradient; a layer does not
            x = x0.clone().requires_grad_()
            return block(x), {"x": x}
        return block(x0), {}  # data: no gradient for the input (a stage's first layer)

    run = fused_and_split(block, forward, dy)
    assert torch.equal(run.split_out, run.fused_out)
    trainable = {n for n, p in block.named_parameters() if p.requires_grad}
    assert set(run.fused) - {"input x"} == trainable, sorted(run.fused)
    for name, fused in run.fused.items():
        assert torch.equal(run.split[name], fused), f"{name}: split != fused (tp {tp}, sp {sp})"


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True)], ids=str)
@pytest.mark.parametrize("frozen", ["", "fc", "fc1.", "fc2.weight"], ids=repr)
def test_split_backward_of_a_data_input_or_a_frozen_layer(
    dist_pool: DistPool, tp: int, sp: bool, frozen: str
) -> None:
    """A linear fed data (no input gradient) must still get its weight gradient, and a
    frozen one none, inside defer_weight_grads: the same gradients as the fused backward
    (``"fc"``: every layer frozen, only the input takes a gradient)."""
    dist_pool.run(_check_data_input_and_frozen, tp, (tp, sp, frozen))
