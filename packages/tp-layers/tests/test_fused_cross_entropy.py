"""fused_linear_cross_entropy == the unfused head (column_parallel_linear, then
vocab_parallel_cross_entropy) and the plain F.linear + F.cross_entropy, in fp32 on CPU.

The vocabulary (10) is padded at tp 3 (to 12): the padding rows must take no part. Token
counts are odd (7 x 3 = 21) or 18 under sequence parallel, so chunks of 4 and 5 leave a
short last chunk; chunks of 1, of all tokens and of more than all tokens are run too. The
upstream gradient is random per token (a masked or weighted mean, as the trainer's loss
functions give), with ignored targets. Tolerance: ``assert_close_to_reference`` with n =
V + H + T, the sums over the vocabulary, the hidden size and the tokens (the weight
gradient) chained. Memory: every op's output in forward and backward is recorded through a
dispatch mode; no tensor of tokens x vocabulary values may appear (the unfused head's
largest is exactly that, so the check can fail).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tp_testing import error_messages
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_tp_layers import (
    column_parallel_linear,
    fused_linear_cross_entropy,
    padded_vocab_size,
    shard_tensor,
    vocab_parallel_cross_entropy,
)

V, H, B = 10, 8, 3
CASES = [(1, False), (2, False), (2, True), (3, False), (3, True)]
IDS = [f"tp{t}-{'sp' if s else 'nosp'}" for t, s in CASES]


def _data(seq: int, ignore_index: int, dev: torch.device) -> tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(seq, B, H, generator=gen)
    w = 0.7 * torch.randn(V, H, generator=gen)
    targets = torch.randint(0, V, (seq, B), generator=gen)
    targets[0, 0], targets[-1, -1] = 0, V - 1  # both ends of the vocabulary
    targets[1, 0] = targets[seq - 2, 2] = ignore_index
    dloss = torch.rand(seq, B, generator=gen)
    return tuple(t.to(dev) for t in (x, w, targets, dloss))


def _check_fused(tp: int, sp: bool) -> None:
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    for smoothing, ignore_index in ((0.0, -100), (0.1, 4)):
        _check_case(g, tp, sp, smoothing, ignore_index)


def _check_case(g: Any, tp: int, sp: bool, smoothing: float, ignore_index: int) -> None:
    rank, dev = dist.get_rank(g), rank_device()
    seq = 6 if sp else 7
    tokens = seq * B
    n = V + H + tokens
    padded = padded_vocab_size(V, tp)
    x, w, targets, dloss = _data(seq, ignore_index, dev)
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss_ref = F.cross_entropy(
        F.linear(x_ref, w_ref).reshape(-1, V), targets.reshape(-1), reduction="none",
        label_smoothing=smoothing, ignore_index=ignore_index,
    ).view(seq, B)  # fmt: skip
    loss_ref.backward(dloss)
    assert x_ref.grad is not None and w_ref.grad is not None
    w_pad = torch.cat([w, w.new_zeros(padded - V, H)])
    x_in = shard_tensor(x, 0, rank, tp) if sp else x

    def run(head: Callable[[Tensor, Tensor], Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        xs = x_in.clone().requires_grad_()
        ws = shard_tensor(w_pad, 0, rank, tp).requires_grad_()
        loss = head(xs, ws)
        loss.backward(dloss)
        assert xs.grad is not None and ws.grad is not None
        return loss.detach(), xs.grad, ws.grad

    def unfused(xs: Tensor, ws: Tensor) -> Tensor:
        logits = column_parallel_linear(xs, ws, tp_group=g, sequence_parallel=sp)
        return vocab_parallel_cross_entropy(
            logits, targets, g, smoothing, ignore_index, vocab_size=V
        )

    expected = run(unfused)
    ref_w_grad = shard_tensor(torch.cat([w_ref.grad, w.new_zeros(padded - V, H)]), 0, rank, tp)
    ref = (loss_ref.detach(), shard_tensor(x_ref.grad, 0, rank, tp) if sp else x_ref.grad,
           ref_w_grad)  # fmt: skip
    for chunk in (1, 4, 5, tokens, tokens + 9):

        def fused(xs: Tensor, ws: Tensor, chunk: int = chunk) -> Tensor:
            return fused_linear_cross_entropy(
                xs, ws, targets, g, sequence_parallel=sp, chunk_size=chunk,
                vocab_size=V, label_smoothing=smoothing, ignore_index=ignore_index,
            )  # fmt: skip

        got = run(fused)
        assert got[0].dtype == torch.float32
        for what, a, e, r in zip(("loss", "dh", "dW"), got, expected, ref, strict=True):
            name = f"{what} (chunk {chunk}, smoothing {smoothing})"
            assert_close_to_reference(a, e, reduction_length=n, name=f"{name} vs unfused")
            assert_close_to_reference(a, r, reduction_length=n, name=f"{name} vs F")
        assert not got[2][max(V - rank * (padded // tp), 0) :].any(), "padding rows got a gradient"
        assert not got[0][targets == ignore_index].any(), "an ignored target has a loss"


@pytest.mark.parametrize(("tp", "sp"), CASES, ids=IDS)
def test_fused_matches_the_unfused_head(dist_pool: DistPool, tp: int, sp: bool) -> None:
    dist_pool.run(_check_fused, tp, args=(tp, sp))


class _Largest(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, Tensor)]
        self.numel = max([self.numel, *sizes])
        return out


def _peaks(tp: int, chunk: int) -> dict[str, tuple[int, int]]:
    """(largest op output, largest saved tensor) of the unfused and the fused head."""
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank, dev = dist.get_rank(g), rank_device()
    tokens, vocab, hidden = 64, 48, 8
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 1, hidden, generator=gen).to(dev)
    w = shard_tensor(torch.randn(vocab, hidden, generator=gen), 0, rank, tp).to(dev)
    targets = torch.randint(0, vocab, (tokens, 1), generator=gen).to(dev)
    heads = {
        "unfused": lambda xs, ws: vocab_parallel_cross_entropy(
            column_parallel_linear(xs, ws, tp_group=g), targets, g
        ),
        "fused": lambda xs, ws: fused_linear_cross_entropy(xs, ws, targets, g, chunk_size=chunk),
    }
    out: dict[str, tuple[int, int]] = {}
    for name, head in heads.items():
        saved: list[int] = []

        def pack(t: Tensor, saved: list[int] = saved) -> Tensor:
            saved.append(t.numel())
            return t

        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        largest = _Largest()
        with largest, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            head(xs, ws).mean().backward()
        out[name] = (largest.numel, max(saved))
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_no_tokens_by_vocabulary_tensor(dist_pool: DistPool, tp: int) -> None:
    tokens, per_rank, hidden, chunk = 64, 48 // tp, 8, 8
    full = tokens * per_rank
    for peaks in dist_pool.run(_peaks, tp, args=(tp, chunk)):
        assert peaks["unfused"][0] >= full and peaks["unfused"][1] >= full  # the logits
        # the fused head's largest: a chunk's logits or the weight (gradient), nothing larger
        bound = max(chunk * per_rank, per_rank * hidden, tokens * hidden)
        assert peaks["fused"][0] <= bound < full, peaks
        assert peaks["fused"][1] <= max(per_rank * hidden, tokens * hidden), peaks


def _integer_targets(tp: int) -> None:
    """Token ids of any integer dtype give what torch.long ids give, bit for bit."""
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank, dev = dist.get_rank(g), rank_device()
    x, w, targets, dloss = _data(6, 4, dev)  # ignore_index 4: a uint8 holds it
    w_shard = shard_tensor(w, 0, rank, tp)
    results = {}
    for dtype in (torch.long, torch.int32, torch.int16, torch.uint8):
        xs, ws = x.clone().requires_grad_(), w_shard.clone().requires_grad_()
        loss = fused_linear_cross_entropy(
            xs, ws, targets.to(dtype), g, chunk_size=4, label_smoothing=0.1, ignore_index=4
        )
        loss.backward(dloss)
        assert xs.grad is not None and ws.grad is not None
        results[dtype] = (loss.detach(), xs.grad, ws.grad)
    for dtype, got in results.items():
        for name, a, b in zip(("loss", "x grad", "w grad"), got, results[torch.long], strict=True):
            assert torch.equal(a, b), f"{name} with {dtype} targets"


@pytest.mark.parametrize("tp", [1, 2])
def test_integer_target_dtypes_give_the_long_targets_loss(dist_pool: DistPool, tp: int) -> None:
    """int16 and uint8 ids raised deep in a gather kernel (int32 and int64 only)."""
    dist_pool.run(_integer_targets, tp, args=(tp,))


def _errors() -> dict[str, str]:
    g = init_process_groups(ParallelConfig()).tp
    x, w, t = torch.randn(4, 2, H), torch.randn(V, H), torch.randint(0, V, (4, 2))
    cases: dict[str, Callable[[], object]] = {
        "chunk": lambda: fused_linear_cross_entropy(x, w, t, g, chunk_size=0),
        "chunk_bool": lambda: fused_linear_cross_entropy(x, w, t, g, chunk_size=True),
        "hidden": lambda: fused_linear_cross_entropy(x[..., :3], w, t, g),
        "targets": lambda: fused_linear_cross_entropy(x, w, t[:3], g),
        "vocab": lambda: fused_linear_cross_entropy(x, w, t, g, vocab_size=V + 1),
        "smoothing": lambda: fused_linear_cross_entropy(x, w, t, g, label_smoothing=1.5),
    }
    out = error_messages(cases)
    try:
        fused_linear_cross_entropy(x, w, t.float(), g)
        out["dtype"] = "no error raised"
    except TypeError as exc:
        out["dtype"] = str(exc)
    return out


def test_bad_input_is_one_sentence(dist_pool: DistPool) -> None:
    [msgs] = dist_pool.run(_errors, 1)
    assert "chunk_size (0) must be a positive number of tokens" in msgs["chunk"]
    assert "chunk_size (True)" in msgs["chunk_bool"]
    assert "hidden shape (4, 2, 3) does not fit weight shape (10, 8)" in msgs["hidden"]
    assert "targets shape (3, 2) does not match the tokens of hidden (4, 2, 8)" in msgs["targets"]
    assert "vocab_size (11) must lie in [1, 10]" in msgs["vocab"]
    assert "label_smoothing (1.5) must lie in [0, 1]" in msgs["smoothing"]
    assert "expects integer targets, got dtype torch.float32" in msgs["dtype"]


def _cuda_bf16() -> dict[str, float]:
    """bf16 on the GPU: the fused head against fp32 math on the same (bf16) values, and the
    memory above the inputs that it and the unfused head allocate."""
    g = init_process_groups(ParallelConfig()).tp
    torch.backends.cuda.matmul.allow_tf32 = False
    tokens, vocab, hidden, chunk = 2000, 8000, 128, 128
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 1, hidden, generator=gen).bfloat16().cuda()
    w = (0.3 * torch.randn(vocab, hidden, generator=gen)).bfloat16().cuda()
    targets = torch.randint(0, vocab, (tokens, 1), generator=gen).cuda()
    dloss = torch.rand(tokens, 1, generator=gen).cuda()
    x_ref, w_ref = x.float().requires_grad_(), w.float().requires_grad_()
    loss_ref = F.cross_entropy(F.linear(x_ref, w_ref).view(tokens, vocab), targets.view(-1),
                               reduction="none").view(tokens, 1)  # fmt: skip
    loss_ref.backward(dloss)
    assert x_ref.grad is not None and w_ref.grad is not None
    heads: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
        "unfused": lambda xs, ws: vocab_parallel_cross_entropy(
            column_parallel_linear(xs, ws, tp_group=g), targets, g
        ),
        "fused": lambda xs, ws: fused_linear_cross_entropy(xs, ws, targets, g, chunk_size=chunk),
    }
    extra: dict[str, float] = {}
    n = vocab + hidden + tokens
    for name, head in heads.items():
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = head(xs, ws)
        loss.backward(dloss)
        torch.cuda.synchronize()
        extra[name] = float(torch.cuda.max_memory_allocated() - base)
        if name == "fused":  # fp32 logits from bf16 products: the loss to fp32 rounding
            assert xs.grad is not None and ws.grad is not None
            assert_close_to_reference(loss, loss_ref, reduction_length=n, name="loss (fp32)")
            assert_close_to_reference(xs.grad, x_ref.grad, reduction_length=n, name="dh (bf16)")
            assert_close_to_reference(ws.grad, w_ref.grad, reduction_length=n, name="dW (bf16)")
    return {**extra, "logits_fp32": 4.0 * tokens * vocab}


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the bf16 GEMMs with fp32 output need CUDA"
)
def test_fused_bf16_on_cuda_matches_fp32_and_holds_no_logits(dist_pool: DistPool) -> None:
    [mem] = dist_pool.run(_cuda_bf16, 1)
    assert mem["unfused"] >= mem["logits_fp32"], mem  # today's head: fp32 logits at least
    assert mem["fused"] < mem["logits_fp32"] / 2, mem  # less than even bf16 logits
