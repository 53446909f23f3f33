"""Document-aware packing: a packed sample computes what its documents compute alone.

fp32 on CPU, one process. The packed run and the per-document runs differ only in the
order of float sums (a masked softmax row sums zeros the short run never sees, the loss
sums documents in another order), so losses and gradients are compared through
``assert_close_to_reference`` with the model's chain of sums as n; a mask that let one
token see another document, or a position that did not restart, moves them by orders of
magnitude more.
"""

from __future__ import annotations

import pytest
import torch
from _tolerance import model_reduction_length

from mega_models import GPTConfig, GPTModel, model_config
from mega_models.doc_mask import (
    DocumentPacking,
    document_attention,
    document_ids,
    document_mask,
    document_positions,
    loss_mask,
)
from mega_parallel_grid.testing import (
    DistPool,
    assert_close_to_reference,
    rank_device,
    solo_groups,
)

EOD = 256
SEQ = 32
PACKING = DocumentPacking(EOD, reset_position_ids=True, reset_attention_mask=True,
                          eod_mask_loss=True)  # fmt: skip


def tiny(**changes: object) -> GPTConfig:
    return model_config("tiny").replace(**changes)


def mla(**changes: object) -> GPTConfig:
    return tiny(
        attention="mla", q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, num_query_groups=8, **changes,
    )  # fmt: skip


def packed(lengths: list[list[int]], seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples of documents of the given lengths (each ending in EOD but a cut-off last
    one), ``seq + 1`` ids each, as (tokens, labels)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for row in lengths:
        ids = torch.randint(0, EOD, (SEQ + 1,), generator=gen)
        ends = torch.tensor(row).cumsum(0) - 1
        ids[ends[ends < SEQ + 1]] = EOD
        rows.append(ids)
    window = torch.stack(rows)
    return window[:, :-1], window[:, 1:]


def test_ids_and_positions() -> None:
    tokens = torch.tensor([[5, 6, EOD, 7, EOD, EOD, 8, 9], [EOD, 1, 2, 3, 4, 5, 6, 7]])
    ids = document_ids(tokens, EOD)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert loss_mask(tokens, EOD).sum().item() == 12


def test_flex_block_mask_equals_dense_mask() -> None:
    """The GPU path's mask_mod (FlexAttention's eager reference on CPU, forward only: it has
    no CPU backward) and the dense mask agree, for one rank and for cp ranks' zig-zag
    queries against all-gathered keys."""
    tokens, _ = packed([[5, 9, 3, 7, 9], [20, 13]])
    ids = document_ids(tokens, EOD)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, SEQ, 8, generator=gen) for h in (4, 2, 2))
    for cp, rank in [(1, 0), (2, 0), (2, 1), (4, 3)]:
        flex = document_mask(ids, cp=cp, cp_rank=rank, backend="flex")
        dense = document_mask(ids, cp=cp, cp_rank=rank, backend="sdpa")
        assert flex.block_mask is not None and dense.block_mask is None
        local = q.index_select(2, dense.q_pos)
        ref = document_attention(local, k.index_select(2, dense.k_pos),
                                 v.index_select(2, dense.k_pos), dense)  # fmt: skip
        out = document_attention(local, k.index_select(2, flex.k_pos),
                                 v.index_select(2, flex.k_pos), flex)  # fmt: skip
        assert_close_to_reference(out, ref, reduction_length=SEQ, name=f"cp{cp} rank{rank}")


def _per_document(
    net: GPTModel, tokens: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Each document of each sample run alone: summed counted losses and their count."""
    total, count = torch.zeros((), device=tokens.device), 0
    ids = document_ids(tokens, EOD)
    for b in range(tokens.shape[0]):
        for d in ids[b].unique().tolist():
            where = ids[b] == d
            t, y = tokens[b, where][None], labels[b, where][None]
            keep = loss_mask(t, EOD)
            total = total + net(t, y)[keep].sum()
            count += int(keep.sum())
    return total / count, count


@pytest.mark.parametrize(
    "config, recompute",
    [(tiny(), "none"), (tiny(), "full"), (tiny(qk_norm=True), "selective"), (mla(), "none")],
    ids=["tiny", "tiny-full-recompute", "qk_norm-selective", "mla"],
)
def test_packed_equals_documents_alone(
    dist_pool: DistPool, config: GPTConfig, recompute: str
) -> None:
    dist_pool.run(_check_packed, 1, args=(config, recompute))


def _check_packed(config: GPTConfig, recompute: str) -> None:
    """On a GPU (NCCL pools) this runs the FlexAttention path, compiled, with its backward."""
    dev = rank_device()
    tokens, labels = (t.to(dev) for t in packed([[5, 9, 3, 7, 9], [20, 13], [40]]))
    net = GPTModel(config, solo_groups(), seed=11, recompute=recompute, device=dev)  # type: ignore[arg-type]
    net.train()
    keep = loss_mask(tokens, EOD)
    per_token = net(tokens, labels, documents=PACKING.documents(tokens))
    loss = per_token[keep].sum() / keep.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad()
    ref, count = _per_document(net, tokens, labels)
    ref.backward()
    assert count == int(keep.sum())
    n = model_reduction_length(config, seq=SEQ, tokens=tokens.numel())
    assert_close_to_reference(loss, ref, reduction_length=n, name="loss")
    assert grads.keys() == {name for name, p in net.named_parameters() if p.grad is not None}
    for name, p in net.named_parameters():
        assert p.grad is not None, name
        assert_close_to_reference(grads[name], p.grad, reduction_length=n, name=name)


def test_packing_changes_the_result(dist_pool: DistPool) -> None:
    """Attention that crosses documents is not the documents alone (the test above could
    not pass by accident). Masked attention alone would be: rope scores depend only on
    the distance between tokens, so resetting positions changes nothing once attention
    stays inside each document (Megatron's switches are separate all the same)."""
    dist_pool.run(_check_changes, 1)


def _check_changes() -> None:
    tokens, labels = packed([[5, 9, 3, 7, 9]])
    net = GPTModel(tiny(), solo_groups(), seed=11)
    keep = loss_mask(tokens, EOD)
    ref, _ = _per_document(net, tokens, labels)
    for switches in [{}, {"reset_position_ids": True}]:
        docs = DocumentPacking(EOD, **switches).documents(tokens)  # type: ignore[arg-type]
        loss = net(tokens, labels, documents=docs)[keep].sum() / keep.sum()
        assert abs(float(loss.detach() - ref.detach())) > 1e-3, switches


@pytest.mark.parametrize(
    "config", [tiny(position="learned"), tiny(mtp_num_layers=1)], ids=["learned", "mtp"]
)
def test_unsupported_models_refuse(dist_pool: DistPool, config: GPTConfig) -> None:
    dist_pool.run(_check_refuses, 1, args=(config,))


def _check_refuses(config: GPTConfig) -> None:
    tokens, labels = packed([[5, 9]])
    net = GPTModel(config, solo_groups(), seed=1)
    with pytest.raises(ValueError, match="packed documents need no MTP"):
        net(tokens, labels, documents=PACKING.documents(tokens))
