"""Hybrid models with MoE (``E``) layers: a dense token-by-token reference, tp / pp / ep
layouts against one process, FLOPs of the activated experts, and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tolerance import model_reduction_length
from torch import Tensor, nn

from mega_models import (
    HybridConfig,
    HybridLayer,
    HybridModel,
    finalize_model_grads,
    hybrid_config,
)
from mega_models.head import embed, lm_head
from mega_models.hybrid_flops import (
    hybrid_activated_matmul_params,
    hybrid_flops_per_token,
    hybrid_matmul_params,
)
from mega_models.rope import rope_tables
from mega_models.stages import stage_spec
from mega_moe import (
    EXPERT_ATTR,
    GroupedMLP,
    MoELayer,
    SequentialMLP,
    expert_shard,
    gather_expert_weight,
    moe_activated_params,
)
from mega_parallel_grid import ParallelConfig, ProcessGroups, init_process_groups
from mega_parallel_grid.testing import (
    DistPool,
    assert_close_to_reference,
    rank_device,
    solo_groups,
)
from mega_tp_layers import gather_full, shard_spec

# fp32 on CPU, as in test_hybrid.py and test_gpt_moe.py: a layout (or the reference's
# token-by-token loop) only reorders float sums, so each tensor is compared through
# ``assert_close_to_reference`` with n the model's chain of sums (N below). Routing is a
# discrete choice, but the top-k logits of random tiny models are far apart compared with
# that rounding.
SEQ, BATCH = 16, 2


def config(**changes: object) -> HybridConfig:
    """4 layers, MoE at 1 and 3 (one per stage at pp 2): 4 experts, top-2, all router losses."""
    base = HybridConfig(
        vocab_size=97, hidden_size=32, pattern="ME*E", num_layers=4, num_attention_heads=4,
        num_query_groups=2, ffn_hidden_size=64, max_seq_len=64, mamba_state_dim=8,
        mamba_head_dim=8, mamba_num_groups=2, mamba_chunk_size=5, num_experts=4, moe_top_k=2,
        moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
        moe_seq_aux_loss_coeff=0.01,
    )  # fmt: skip
    return base.replace(**changes)


# gradients sum over every dp rank's batch (dp <= 4 here)
N = model_reduction_length(config(), seq=SEQ, tokens=4 * SEQ * BATCH)


def batch(c: HybridConfig, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, c.vocab_size, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


# config -----------------------------------------------------------------------------------


def test_the_pattern_says_which_layers_are_moe() -> None:
    c = config()
    assert c.is_moe and c.moe_layers == (1, 3)
    assert [c.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    tiny = hybrid_config("hybrid-moe-tiny")
    assert tiny.pattern == "M*MEM*ME" and tiny.moe_layers == (3, 7)
    assert (tiny.num_experts, tiny.moe_top_k, tiny.count("-")) == (8, 2, 0)
    dense = hybrid_config("hybrid-tiny")
    assert not dense.is_moe and dense.moe_layers == ()


def _one_sentence(build: object) -> str:
    with pytest.raises(ValueError) as info:
        build()  # type: ignore[operator]
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_moe_config_is_one_sentence() -> None:
    assert _one_sentence(lambda: config(num_experts=0)) == (
        "pattern 'ME*E' has an MoE layer at position 1 but num_experts is 0; set num_experts "
        "(and moe_top_k) or use '-' for a dense MLP"
    )
    assert _one_sentence(lambda: config(pattern="M-*-")) == (
        "num_experts (4) is set but pattern 'M-*-' has no MoE layer; put an 'E' in the "
        "pattern or set num_experts to 0"
    )
    assert _one_sentence(lambda: config(moe_layer_pattern="-E-E")) == (
        "moe_layer_pattern ('-E-E') does not apply to hybrid models; leave it None and mark "
        "the MoE layers with 'E' in pattern"
    )
    assert _one_sentence(lambda: config(moe_layer_freq=2)) == (
        "moe_layer_freq (2) does not apply to hybrid models; leave it at 1 and mark the MoE "
        "layers with 'E' in pattern"
    )
    # GPT's MoE checks still apply
    assert _one_sentence(lambda: config(moe_top_k=5)).startswith(
        "moe_top_k (5) must be between 1 and num_experts (4)"
    )
    assert _one_sentence(lambda: config(add_bias=True)).startswith(
        "add_bias is not supported with MoE layers"
    )


def _model_errors() -> list[str]:
    ep2 = init_process_groups(ParallelConfig(ep=2))
    tp2 = init_process_groups(ParallelConfig(tp=2))
    return [
        _one_sentence(lambda: HybridModel(config(num_experts=3), ep2)),
        _one_sentence(lambda: HybridModel(config(moe_ffn_hidden_size=33), tp2)),
    ]


def test_bad_expert_layout_fails_at_construction(dist_pool: DistPool) -> None:
    for first, second in dist_pool.run(_model_errors, 2):
        assert first.startswith("num_experts (3) is not divisible by ep (2)"), first
        assert second.startswith("ffn_hidden_size (33) is not divisible by etp (2)"), second


# single process against a dense loop --------------------------------------------------------


def _expert_weights(layer: MoELayer) -> tuple[Tensor, Tensor]:
    """Every expert's ``weight1 [E, 2, f, h]`` (gate, up) and ``weight2 [E, h, f]``."""
    experts = layer.experts
    if isinstance(experts, GroupedMLP):
        return experts.weight1, experts.weight2
    assert isinstance(experts, SequentialMLP)
    mods = [experts.local_experts[str(e)] for e in range(len(experts.local_experts))]
    return torch.stack([m.weight1 for m in mods]), torch.stack([m.weight2 for m in mods])


def _dense_moe(layer: MoELayer, y: Tensor, top_k: int) -> Tensor:
    """Token by token: router logits, the top-k of them, softmax over those k, and the
    weighted sum of the chosen experts' SwiGLU MLPs."""
    w1, w2 = _expert_weights(layer)
    router = layer.router.weight  # [E, h]
    out = []
    for token in y.reshape(-1, y.shape[-1]):  # [s, b, h] -> s*b tokens of [h]
        logits = router @ token
        chosen = torch.topk(logits, top_k).indices
        weights = torch.softmax(logits[chosen], dim=0)
        mixed = torch.zeros_like(token)
        for weight, e in zip(weights, chosen.tolist(), strict=True):
            gate, up = w1[e, 0] @ token, w1[e, 1] @ token
            mixed = mixed + weight * (w2[e] @ (F.silu(gate) * up))
        out.append(mixed)
    return torch.stack(out).view_as(y)


def _against_dense_loop(changes: dict[str, object]) -> tuple[int, float]:
    c = config(**changes)
    model = HybridModel(c, solo_groups(), seed=21)
    ids, _ = batch(c, 3)
    with torch.no_grad():
        logits = model(ids)
        assert model.embedding is not None and model.final_norm is not None
        positions = torch.arange(SEQ)
        hidden = embed(model.embedding, ids.t(), positions, sequence_parallel=False,
                       tp_group=model.tp_group)  # fmt: skip
        rope = rope_tables(c.head_dim, positions, c.rope_theta, hidden.dtype)
        routed = 0
        for layer in model.layers.values():
            assert isinstance(layer, HybridLayer)
            if layer.kind == "E":
                assert isinstance(layer.mlp, MoELayer)
                hidden = hidden + _dense_moe(layer.mlp, layer.norm(hidden), c.moe_top_k)
                routed += 1
            else:
                hidden = layer(hidden, rope, SEQ)
        expected = lm_head(
            hidden, None, final_norm=model.final_norm, output=model.output, tied_weight=None,
            tp_group=model.tp_group, sequence_parallel=False, vocab_size=c.vocab_size,
        )  # fmt: skip
    assert_close_to_reference(logits, expected, reduction_length=N, name="logits")
    return routed, float((logits - expected).abs().max())


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "sequential"])
def test_forward_equals_a_dense_loop_over_tokens_and_experts(
    dist_pool: DistPool, grouped: bool
) -> None:
    [(routed, _)] = dist_pool.run(_against_dense_loop, 1, args=({"moe_grouped_experts": grouped},))
    assert routed == 2


def _names_and_recompute() -> list[str]:
    c = config()
    ids, labels = batch(c, 0)
    plain = HybridModel(c, solo_groups(), seed=3)
    plain(ids, labels).mean().backward()
    again = HybridModel(c, solo_groups(), seed=3, recompute="full")
    again(ids, labels).mean().backward()
    for (name, a), b in zip(plain.named_parameters(), again.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=f"full recompute {name}")
    return [n for n, p in plain.named_parameters() if ".mlp." in n]


def test_moe_layers_are_named_like_gpt_and_recompute_exactly(dist_pool: DistPool) -> None:
    [names] = dist_pool.run(_names_and_recompute, 1)
    assert names == [
        f"layers.{i}.mlp.{w}" for i in (1, 3)
        for w in ("router.weight", "experts.weight1", "experts.weight2")
    ]  # fmt: skip


# layouts against one process ----------------------------------------------------------------


def full_tensors(model: HybridModel, groups: ProcessGroups, grads: bool) -> dict[str, Tensor]:
    """Every parameter (or gradient) in full: experts gathered over ep x etp, the rest over
    tp; vocabulary padding cut."""
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p.detach()
        assert t is not None, f"{name} has no gradient"
        shard = expert_shard(p)
        if shard is not None:
            holder = nn.Parameter(t.detach().clone())
            setattr(holder, EXPERT_ATTR, shard)
            t = gather_expert_weight(holder, groups.ep, groups.etp)
        else:
            spec = shard_spec(p)
            if spec is not None and spec.dim is not None and spec.num_shards > 1:
                t = gather_full(t.detach(), spec, groups.tp)
        if name in ("embedding.word.weight", "output.weight"):
            t = t[: model.config.vocab_size]
        out[name] = t.detach().cpu().clone()
    return out


def compare(mine: dict[str, Tensor], ref: dict[str, Tensor], what: str) -> None:
    assert mine and set(mine) <= set(ref), f"{what}: unknown names {set(mine) - set(ref)}"
    for name, value in mine.items():
        assert_close_to_reference(value, ref[name], reduction_length=N, name=f"{what} {name}")


def run_stages(model: HybridModel, groups: ProcessGroups, ids: Tensor,
               labels: Tensor) -> Tensor | None:  # fmt: skip
    """Forward and backward of the mean loss through the pipeline, by hand (send/recv)."""
    me, dev = groups.rank("pp"), rank_device()
    ranks = dist.get_process_group_ranks(groups.pp)
    x: Tensor = ids.to(dev)
    if not model.stage.first:
        tp = groups.size("tp") if model.sequence_parallel else 1
        x = torch.empty(SEQ // tp, BATCH, model.config.hidden_size, device=dev)
        dist.recv(x, ranks[me - 1])
        x.requires_grad_()
    out = model(x, labels.to(dev) if model.stage.last else None)
    if model.stage.last:
        out.mean().backward()
    else:
        dist.send(out.detach().contiguous(), ranks[me + 1])
        grad = torch.empty_like(out)
        dist.recv(grad, ranks[me + 1])
        out.backward(grad)
    if not model.stage.first:
        assert x.grad is not None
        dist.send(x.grad.contiguous(), ranks[me - 1])
    return out.detach().cpu() if model.stage.last else None


def _sum_over(model: nn.Module, group: dist.ProcessGroup, experts: bool) -> None:
    for p in model.parameters():
        if p.grad is not None and (expert_shard(p) is not None) == experts:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)


def _contract(
    tp: int, pp: int, ep: int, etp: int | None, sp: bool, changes: dict[str, object]
) -> None:
    """Each dp rank routes its own batch; gradients summed over dp (experts over edp) equal
    the one-process model's gradients of the summed objective (LM loss + router losses)."""
    c = config(**changes)
    groups = init_process_groups(ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp))
    stage = stage_spec(c.num_layers, pp, groups.rank("pp"))
    dev = rank_device()
    ref = HybridModel(c, solo_groups(), seed=5, device=dev)
    model = HybridModel(c, groups, stage=stage, sequence_parallel=sp, seed=5, device=dev)
    assert sum(isinstance(m, MoELayer) for m in model.modules()) == sum(
        c.pattern[i] == "E" for i in stage.layers
    )
    compare(full_tensors(model, groups, False), full_tensors(ref, solo_groups(), False), "init")
    dp, dp_rank = groups.size("dp"), groups.rank("dp")
    mine_ref = None
    for d in range(dp):  # the reference sees every dp rank's batch; router losses weigh 1 each
        ids, labels = batch(c, 7 + d)
        ref_loss = ref(ids.to(dev), labels.to(dev))
        ref_loss.mean().backward()
        if d == dp_rank:
            mine_ref = ref_loss.detach().cpu()
    ids, labels = batch(c, 7 + dp_rank)
    loss = run_stages(model, groups, ids, labels)
    if loss is not None:
        assert mine_ref is not None
        assert_close_to_reference(loss, mine_ref, reduction_length=N, name="per-token loss")
    finalize_model_grads(model, groups)
    _sum_over(model, groups.dp, experts=False)
    _sum_over(model, groups.edp, experts=True)
    compare(full_tensors(model, groups, True), full_tensors(ref, solo_groups(), True), "grad")


LAYOUTS = [
    (1, 1, 2, None, False, {}),  # ep 2 folded over dp 2
    (2, 1, 1, None, True, {"moe_shared_expert_size": 32, "moe_shared_expert_gate": True}),
    (2, 1, 2, 1, False, {"moe_dispatcher": "allgather", "moe_grouped_experts": False}),
    (1, 2, 2, None, False, {"moe_score_function": "sigmoid", "moe_normalize_topk": True}),
]


@pytest.mark.parametrize(
    ("tp", "pp", "ep", "etp", "sp", "changes"),
    LAYOUTS,
    ids=["ep2-dp2", "tp2-etp2-sp-shared", "tp2-ep2-etp1-allgather-sequential", "pp2-ep2-dp2"],
)
def test_hybrid_moe_layouts_match_single_process(
    dist_pool: DistPool,
    tp: int,
    pp: int,
    ep: int,
    etp: int | None,
    sp: bool,
    changes: dict[str, object],
) -> None:
    world = pp * max(tp, ep * (etp or tp))
    dist_pool.run(_contract, world, args=(tp, pp, ep, etp, sp, changes))


# FLOPs --------------------------------------------------------------------------------------


def test_flops_count_only_activated_experts() -> None:
    c = config(moe_shared_expert_size=32)
    dense = config(pattern="M-*-", num_experts=0)  # the same model with MLPs in place of E
    h, f = c.hidden_size, 32
    per_moe = moe_activated_params(h, c.moe_config())
    per_mlp = 3 * h * c.ffn_size
    # router h*E, the top-2 of 4 SwiGLU experts (3 h f each), one shared expert of 32
    assert per_moe == h * 4 + 2 * 3 * h * f + 3 * h * 32
    base = hybrid_matmul_params(dense)
    assert hybrid_activated_matmul_params(c) == base + 2 * (per_moe - per_mlp)
    every_expert = h * 4 + 4 * 3 * h * f + 3 * h * 32
    assert hybrid_matmul_params(c) == base + 2 * (every_expert - per_mlp)
    assert hybrid_activated_matmul_params(dense) == base
    for s in (16, 128):
        extra = 3 * 2 * 2 * (per_moe - per_mlp)  # fwd+bwd, 2 per weight, 2 E layers
        assert hybrid_flops_per_token(c, s) == hybrid_flops_per_token(dense, s) + extra


def _counted_flops() -> tuple[float, float]:
    from torch.utils.flop_counter import FlopCounterMode

    # as in test_hybrid.py: no attention, no vocabulary padding, chunks dividing the sequence;
    # experts as a loop of GEMMs (the counter does not see torch._grouped_mm on the CPU)
    c = config(vocab_size=96, mamba_chunk_size=4, pattern="M-ME", moe_shared_expert_size=32,
               moe_grouped_experts=False)  # fmt: skip
    model = HybridModel(c, solo_groups(), seed=1)
    ids, _ = batch(c, 0)
    with FlopCounterMode(display=False) as counter:
        model(ids)
    tokens = SEQ * BATCH
    # the combine (each token's k expert outputs weighted and summed) is element-wise work,
    # which neither the formula (like GPT's) nor the counter counts
    return counter.get_total_flops(), hybrid_flops_per_token(c, SEQ) / 3 * tokens


def test_flop_formula_matches_counted_forward(dist_pool: DistPool) -> None:
    """Each token's router, its top-2 experts and the shared expert, and no other expert."""
    [(counted, formula)] = dist_pool.run(_counted_flops, 1)
    assert counted == formula
