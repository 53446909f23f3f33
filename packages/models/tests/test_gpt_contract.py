"""GPTModel at tp x cp (with and without sequence parallel) equals the unsplit model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _tolerance import model_reduction_length
from torch import nn

from mega_models import GPTConfig, GPTModel, finalize_model_grads, model_config
from mega_models.context_parallel import zigzag_split
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import (
    DistPool,
    assert_close_to_reference,
    rank_device,
    solo_groups,
)
from mega_tp_layers import gather_full, shard_spec

# fp32 on CPU. A parallel layout changes only the order of float additions (tp splits
# GEMM reductions and sums partials; cp merges softmax blocks; SP all-reduces norm grads).
# Rounding error of a sum grows with the magnitude of its terms, not of its result, so
# each tensor is compared through ``assert_close_to_reference``: a multiple of
# u · sqrt(n) · max|ref| with n the model's chain of sums (``model_reduction_length``); any
# real error (a missing shard, a wrong mask, a lost gradient) is orders of magnitude larger.
SEQ, BATCH = 16, 2
N = model_reduction_length(model_config("tiny"), seq=SEQ, tokens=SEQ * BATCH)


def tiny(**changes: object) -> GPTConfig:
    return model_config("tiny").replace(**changes)


def batch(config: GPTConfig, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def full_params(model: nn.Module, vocab_size: int, grads: bool) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) gathered over its shard group, padding rows cut."""
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p.detach()
        assert t is not None, f"{name} has no gradient"
        spec = shard_spec(p)
        group = getattr(model, "tp_group", None)
        if spec is not None and spec.dim is not None and spec.num_shards > 1:
            assert group is not None
            t = gather_full(t.detach(), spec, group)
        if t.shape[0] > vocab_size and ("embedding.word" in name or name.startswith("output")):
            if grads:  # padding rows never take part
                assert bool((t[vocab_size:] == 0).all()), f"{name} padding has a gradient"
            t = t[:vocab_size]
        out[name] = t.detach().clone()
    return out


def compare(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str) -> None:
    # no pipeline split here: every rank holds (a shard of) every parameter
    assert set(mine) == set(ref), f"{what}: names differ {set(mine) ^ set(ref)}"
    for name, value in mine.items():
        assert_close_to_reference(value, ref[name], reduction_length=N, name=f"{what} {name}")


def all_reduce_grads(model: nn.Module, group: dist.ProcessGroup) -> None:
    for p in model.parameters():
        if p.grad is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)


def _contract(tp: int, cp: int, sp: bool, cp_method: str, changes: dict[str, object]) -> None:
    """Parameters, per-token losses and gradients of the parallel model equal the reference's."""
    config = tiny(**changes)
    groups = init_process_groups(ParallelConfig(tp=tp, cp=cp))
    dev = rank_device()  # the reference runs on the same device: same kernels' rounding
    ref_model = GPTModel(config, solo_groups(), seed=11, device=dev)
    model = GPTModel(config, groups, sequence_parallel=sp, cp_method=cp_method, seed=11, device=dev)  # type: ignore[arg-type]
    compare(
        full_params(model, config.vocab_size, grads=False),
        full_params(ref_model, config.vocab_size, grads=False),
        "init",
    )

    ids, labels = batch(config)
    ref_loss = ref_model(ids.to(dev), labels.to(dev)).cpu()  # [b, s] per-token losses
    ref_loss.sum().backward()
    cp_rank = groups.rank("cp")
    loss = model(
        zigzag_split(ids, cp, cp_rank, dim=1).to(dev),
        zigzag_split(labels, cp, cp_rank, dim=1).to(dev),
    )
    assert loss.shape == (BATCH, SEQ // cp)
    loss.sum().backward()
    finalize_model_grads(model, groups)
    all_reduce_grads(model, groups.cp)  # each cp rank saw part of the tokens
    # each rank's per-token losses (its zigzag share of the sequence) against the reference's
    assert_close_to_reference(
        loss, zigzag_split(ref_loss.detach(), cp, cp_rank, dim=1), reduction_length=N,
        name="per-token loss",
    )  # fmt: skip
    mine = {k: v.cpu() for k, v in full_params(model, config.vocab_size, grads=True).items()}
    compare(mine, full_params(ref_model, config.vocab_size, grads=True), "grad")


LAYOUTS = [
    (1, 1, False),
    (2, 1, False),
    (2, 1, True),
    (4, 1, False),
    (4, 1, True),
    (1, 2, False),
    (2, 2, True),
]


@pytest.mark.parametrize(("tp", "cp", "sp"), LAYOUTS, ids=lambda v: str(v))
def test_gpt_layouts_match_single_process(dist_pool: DistPool, tp: int, cp: int, sp: bool) -> None:
    dist_pool.run(_contract, tp * cp, args=(tp, cp, sp, "ring", {}))


@pytest.mark.parametrize(
    "changes",
    [
        {"norm": "layernorm", "activation": "gelu", "position": "learned", "add_bias": True},
        {"tie_embeddings": True, "qk_norm": True, "num_query_groups": 2},
    ],
    ids=["layernorm-gelu-learned-bias", "tied-qknorm-gqa2"],
)
def test_gpt_variants_tp2_sp(dist_pool: DistPool, changes: dict[str, object]) -> None:
    dist_pool.run(_contract, 2, args=(2, 1, True, "ring", changes))


def test_gpt_cp_all_gather_with_tp(dist_pool: DistPool) -> None:
    dist_pool.run(_contract, 4, args=(2, 2, False, "all_gather", {"position": "learned"}))


def _recompute(mode: str) -> None:
    config = tiny(hidden_dropout=0.0)
    groups = init_process_groups(ParallelConfig(tp=2))
    plain = GPTModel(config, groups, sequence_parallel=True, seed=3)
    again = GPTModel(config, groups, sequence_parallel=True, seed=3, recompute=mode)  # type: ignore[arg-type]
    ids, labels = batch(config)
    for m in (plain, again):
        m(ids, labels).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), again.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_identical_gradients(dist_pool: DistPool, mode: str) -> None:
    dist_pool.run(_recompute, 2, args=(mode,))


def _dropout_recompute(mode: str) -> None:
    """With dropout under SP, recompute replays the same masks (tracked RNG): hidden and
    attention dropout together, then attention dropout alone (the selective path recomputes
    only the attention core, so it must replay the attention-probability masks)."""
    from mega_tp_layers import tp_rng_tracker

    groups = init_process_groups(ParallelConfig(tp=2))
    for hidden, attention in ((0.1, 0.1), (0.0, 0.1)):
        grads = []
        for recompute, scale in (("none", 1.0), (mode, 1.0), ("none", 0.0)):
            config = tiny(hidden_dropout=hidden * scale, attention_dropout=attention * scale)
            torch.manual_seed(5)
            rng = tp_rng_tracker(99, groups.tp)
            model = GPTModel(
                config, groups, sequence_parallel=True, seed=3, recompute=recompute, rng=rng
            )  # type: ignore[arg-type]
            ids, labels = batch(config)
            model(ids, labels).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        what = f"hidden {hidden}, attention {attention}"
        for a, b in zip(grads[0], grads[1], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, w=what: f"{w}: {m}")
        # the dropout did act: without it the gradients differ
        assert any(not torch.equal(a, c) for a, c in zip(grads[0], grads[2], strict=True)), what


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_dropout_masks_replayed_by_recompute(dist_pool: DistPool, mode: str) -> None:
    dist_pool.run(_dropout_recompute, 2, args=(mode,))
