"""VocabParallelEmbedding and vocab_parallel_cross_entropy == nn.Embedding / F.cross_entropy.

The vocabulary (10) is not divisible by tp 3 or 4, so those runs exercise the padding rule
(10 -> 12 rows). Tolerance: fp32, sums over the vocabulary (V), the hidden size (H, the tied
head) and the S·B tokens (a weight gradient) reordered across ranks: the rounding bound of
``assert_close_to_reference`` with n = V + H + S·B. Random values are drawn on the CPU (the
same on any machine) and the reference then runs on the layers' device (``rank_device()``):
CPU and GPU kernels round differently, which this tolerance does not cover.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, rank_device
from mega_tp_layers import (
    ColumnParallelLinear,
    Normal,
    VocabParallelEmbedding,
    column_parallel_linear,
    fused_linear_cross_entropy,
    gather_full,
    init_full,
    padded_vocab_size,
    param_generator,
    shard_spec,
    shard_tensor,
    vocab_parallel_cross_entropy,
)

SEED = 5
V, H, S, B = 10, 8, 12, 2
N = V + H + S * B  # longest chain of sums behind one element (see the module doc)
CASES = [(tp, sp) for tp in (1, 2, 3, 4) for sp in (False, True)]
IDS = [f"tp{t}-{'sp' if s else 'nosp'}" for t, s in CASES]


def _close(actual: Tensor, expected: Tensor, what: str) -> None:
    assert_close_to_reference(actual, expected, reduction_length=N, name=what)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _seq(x: Tensor, sp: bool, rank: int, tp: int) -> Tensor:
    return shard_tensor(x, 0, rank, tp) if sp else x.clone()


def _check_embedding(tp: int, sp: bool) -> None:
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank, dev = dist.get_rank(g), rank_device()
    emb = VocabParallelEmbedding(
        V, H, tp_group=g, sequence_parallel=sp, init_method=Normal(1.0), seed=SEED,
        name="embed", device=dev,
    )  # fmt: skip
    padded = padded_vocab_size(V, tp)
    assert emb.padded_num_embeddings == padded
    full = init_full((V, H), Normal(1.0), param_generator(SEED, "embed.weight"))
    spec = shard_spec(emb.weight)
    assert spec is not None and spec.full_shape == (padded, H)
    # the real rows are drawn as if unpadded (so tp does not change them); padding is zero
    assert torch.equal(gather_full(emb.weight, spec, g).cpu(), _pad_rows(full, padded))

    ids = torch.randint(0, V, (S, B))
    ids[0, 0], ids[-1, -1] = 0, V - 1  # both ends of the vocabulary
    ids, dy = ids.to(dev), torch.randn(S, B, H).to(dev)
    ref_w = full.to(dev, copy=True).requires_grad_()  # the reference, on the layer's device
    y_ref = F.embedding(ids, ref_w)
    y_ref.backward(dy)

    y = emb(ids)  # every rank looks up the whole sequence; SP scatters the result
    y.backward(_seq(dy, sp, rank, tp))
    _close(y, _seq(y_ref, sp, rank, tp), "embedding output")
    assert ref_w.grad is not None and emb.weight.grad is not None
    _close(emb.weight.grad, shard_tensor(ref_w.grad, spec), "embedding weight grad")


@pytest.mark.parametrize(("tp", "sp"), CASES, ids=IDS)
def test_embedding_matches_nn_embedding(dist_pool: DistPool, tp: int, sp: bool) -> None:
    dist_pool.run(_check_embedding, tp, args=(tp, sp))


def _check_cross_entropy(tp: int, smoothing: float, ignore_index: int) -> None:
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank, dev = dist.get_rank(g), rank_device()
    padded = padded_vocab_size(V, tp)
    logits = 3.0 * torch.randn(S, B, V)
    targets = torch.randint(0, V, (S, B))
    targets[1, 0] = targets[4, 1] = ignore_index  # some ignored tokens
    targets[2, 0], targets[3, 1] = 0, V - 1
    dloss = torch.rand(S, B)
    logits, targets, dloss = logits.to(dev), targets.to(dev), dloss.to(dev)

    ref_logits = logits.clone().requires_grad_()  # the reference, on the layer's device
    loss_ref = F.cross_entropy(
        ref_logits.reshape(-1, V), targets.reshape(-1), reduction="none",
        label_smoothing=smoothing, ignore_index=ignore_index,
    ).view(S, B)  # fmt: skip
    loss_ref.backward(dloss)
    assert ref_logits.grad is not None

    # padding columns hold huge values: they must take no part in the loss
    garbage = torch.full((S, B, padded - V), 1e4, device=dev)
    shard = shard_tensor(torch.cat([logits, garbage], -1), -1, rank, tp).requires_grad_()
    loss = vocab_parallel_cross_entropy(
        shard, targets, g, label_smoothing=smoothing, ignore_index=ignore_index, vocab_size=V,
    )  # fmt: skip
    loss.backward(dloss)
    assert loss.dtype == torch.float32 and shard.grad is not None
    _close(loss, loss_ref, "loss")
    grad_ref = torch.cat([ref_logits.grad, torch.zeros(S, B, padded - V, device=dev)], -1)
    _close(shard.grad, shard_tensor(grad_ref, -1, rank, tp), "logits grad (padding: zero)")


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("smoothing", "ignore_index"), [(0.0, -100), (0.1, -100), (0.2, 3)], ids=str
)
def test_cross_entropy_matches_f_cross_entropy(
    dist_pool: DistPool, tp: int, smoothing: float, ignore_index: int
) -> None:
    dist_pool.run(_check_cross_entropy, tp, args=(tp, smoothing, ignore_index))


def _check_language_model(tp: int, sp: bool) -> None:
    """Embedding -> (untied column head | tied head) -> mean loss, against the full model."""
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    dev = rank_device()
    emb = VocabParallelEmbedding(
        V, H, tp_group=g, sequence_parallel=sp, init_method=Normal(1.0), seed=SEED,
        name="embed", device=dev,
    )  # fmt: skip
    head = ColumnParallelLinear(
        H, V, tp_group=g, bias=False, sequence_parallel=sp, pad_out_features=True,
        init_method=Normal(0.5), seed=SEED, name="head", device=dev,
    )  # fmt: skip
    # drawn on the CPU, then moved: the reference runs on the layers' device
    w_emb = init_full((V, H), Normal(1.0), param_generator(SEED, "embed.weight")).to(dev)
    w_head = init_full((V, H), Normal(0.5), param_generator(SEED, "head.weight")).to(dev)
    ids, targets = torch.randint(0, V, (S, B)).to(dev), torch.randint(0, V, (S, B)).to(dev)

    for tied in (False, True):
        emb.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
        e_ref = w_emb.clone().requires_grad_()
        h_ref = e_ref if tied else w_head.clone().requires_grad_()
        loss_ref = F.cross_entropy(F.linear(F.embedding(ids, e_ref), h_ref).reshape(-1, V),
                                   targets.reshape(-1))  # fmt: skip
        loss_ref.backward()

        hidden = emb(ids)  # [s, b, h], or [s/tp, b, h] under SP
        if tied:
            logits = column_parallel_linear(hidden, emb.weight, tp_group=g, sequence_parallel=sp)
        else:
            logits = head(hidden)  # [s, b, V_pad/tp]
        loss = vocab_parallel_cross_entropy(logits, targets, g, vocab_size=V).mean()
        loss.backward()
        _close(loss, loss_ref, f"loss (tied={tied})")
        assert e_ref.grad is not None and emb.weight.grad is not None
        spec = shard_spec(emb.weight)
        assert spec is not None
        _close(emb.weight.grad, shard_tensor(e_ref.grad, spec), f"embedding grad (tied={tied})")
        if not tied:
            head_spec = shard_spec(head.weight)
            assert h_ref.grad is not None and head.weight.grad is not None and head_spec
            _close(head.weight.grad, shard_tensor(h_ref.grad, head_spec), "head grad")


@pytest.mark.parametrize(("tp", "sp"), CASES, ids=IDS)
def test_language_model_loss_matches_single_process(dist_pool: DistPool, tp: int, sp: bool) -> None:
    dist_pool.run(_check_language_model, tp, args=(tp, sp))


def _out_of_range_targets(tp: int) -> tuple[list[float], float]:
    """Targets in the padding ([V, V_pad)), beyond it, and negative (not ignore_index)."""
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank, dev = dist.get_rank(g), rank_device()
    vocab = 7  # padded to 8 at tp 1, 2 and 4
    padded = padded_vocab_size(vocab, tp, multiple_of=8 // tp)
    assert padded > vocab, "the case needs a padded vocabulary"
    logits = torch.randn(4, 1, padded, generator=torch.Generator().manual_seed(1)).to(dev)
    targets = torch.tensor([[2], [padded - 1], [padded + 5], [-3]], device=dev)
    shard = shard_tensor(logits, -1, rank, tp).requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, targets, g, vocab_size=vocab)
    loss[0].sum().backward()  # only the valid token's loss is finite
    assert shard.grad is not None
    full = [torch.empty_like(shard.grad) for _ in range(tp)]
    dist.all_gather(full, shard.grad.detach().contiguous(), group=g)
    pad_grad = torch.cat(full, -1)[..., vocab:]
    return loss.flatten().tolist(), float(pad_grad.abs().max())


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_targets_outside_the_vocabulary_give_an_infinite_loss(dist_pool: DistPool, tp: int) -> None:
    """At every tp, tp 1's single-shard path too (where F.cross_entropy would raise)."""
    for losses, pad_grad in dist_pool.run(_out_of_range_targets, tp, args=(tp,)):
        assert math.isfinite(losses[0])
        assert losses[1:] == [math.inf] * 3  # never a finite wrong loss
        assert pad_grad == 0.0


def _integer_targets(tp: int) -> None:
    """Token ids of any integer dtype give what torch.long ids give, bit for bit."""
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank, dev = dist.get_rank(g), rank_device()
    gen = torch.Generator().manual_seed(2)
    logits = (3.0 * torch.randn(S, B, V + 2, generator=gen)).to(dev)  # 12 = V padded
    targets = torch.randint(0, V, (S, B), generator=gen).to(dev)
    dloss = torch.rand(S, B, generator=gen).to(dev)
    results = {}
    for dtype in (torch.long, torch.int32, torch.int16, torch.uint8):
        shard = shard_tensor(logits, -1, rank, tp).requires_grad_()
        loss = vocab_parallel_cross_entropy(
            shard, targets.to(dtype), g, label_smoothing=0.1, vocab_size=V
        )
        loss.backward(dloss)
        assert shard.grad is not None
        results[dtype] = (loss.detach(), shard.grad)
    for dtype, (loss, grad) in results.items():
        assert torch.equal(loss, results[torch.long][0]), f"loss with {dtype} targets"
        assert torch.equal(grad, results[torch.long][1]), f"gradient with {dtype} targets"


@pytest.mark.parametrize("tp", [1, 2])
def test_integer_target_dtypes_give_the_long_targets_loss(dist_pool: DistPool, tp: int) -> None:
    """int32 ids (a common data-loader dtype) raised at tp 1 and worked at tp 2; int16 and
    uint8 raised deep in a kernel at tp 2."""
    dist_pool.run(_integer_targets, tp, args=(tp,))


def _fractional_vocab_size(tp: int) -> list[str]:
    """Each rank's error for a vocab_size that is not an integer (plain and fused head)."""
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank, dev = dist.get_rank(g), rank_device()
    logits = shard_tensor(torch.randn(S, B, 8), -1, rank, tp).to(dev)
    hidden, w = torch.randn(S, B, H).to(dev), shard_tensor(torch.randn(8, H), 0, rank, tp).to(dev)
    targets = torch.randint(0, 7, (S, B)).to(dev)
    messages = []
    for head in (
        lambda: vocab_parallel_cross_entropy(logits, targets, g, vocab_size=7.5),  # type: ignore[arg-type]
        lambda: fused_linear_cross_entropy(hidden, w, targets, g, vocab_size=7.5),  # type: ignore[arg-type]
    ):
        try:
            head()
            messages.append("no error raised")
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_fractional_vocab_size_is_one_sentence_on_every_rank(dist_pool: DistPool) -> None:
    """7.5 lay in [1, 8]: rank 1 (real columns 3.5) failed slicing while rank 0 (4) waited
    in the MAX all-reduce for it, a hang."""
    for messages in dist_pool.run(_fractional_vocab_size, 2, args=(2,), timeout=60):
        for msg in messages:
            assert "vocab_size (7.5) must lie in [1, 8] and be an integer" in msg, msg


def _gathered_padded_head(tp: int) -> tuple[int, ...]:
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    head = ColumnParallelLinear(
        H, 7, tp_group=g, bias=False, pad_out_features=True, gather_output=True, seed=SEED,
        device=rank_device(),
    )  # fmt: skip
    assert head.out_features_per_rank * tp > 7  # padded
    return tuple(head(torch.randn(S, B, H, device=rank_device())).shape)


@pytest.mark.parametrize("tp", [2, 4])
def test_gathered_output_of_a_padded_head_has_the_real_width(dist_pool: DistPool, tp: int) -> None:
    assert dist_pool.run(_gathered_padded_head, tp, args=(tp,)) == [(S, B, 7)] * tp
