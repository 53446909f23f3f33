"""GPT with mixture-of-experts layers: config, FLOPs, and ep / etp / tp layouts against one process."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest
import torch
import torch.distributed as dist
from _tolerance import model_reduction_length
from torch import nn

from mega_models import (
    GPTConfig,
    GPTModel,
    finalize_model_grads,
    forward_flops_per_token,
    matmul_params,
    model_config,
)
from mega_models.flops import activated_matmul_params
from mega_moe import (
    EXPERT_ATTR,
    MoELayer,
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

# fp32 on CPU, as in test_gpt_contract.py: layouts reorder float sums, so each tensor is
# compared through ``assert_close_to_reference`` with n the model's chain of sums (N below).
SEQ, BATCH = 16, 2

MOE = {
    "hidden_size": 32, "num_layers": 2, "num_attention_heads": 4, "num_query_groups": 2,
    "num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 32, "moe_aux_loss_coeff": 0.01,
    "moe_z_loss_coeff": 0.001, "moe_seq_aux_loss_coeff": 0.01,
}  # fmt: skip


def moe(**changes: object) -> GPTConfig:
    return model_config("tiny").replace(**{**MOE, **changes})


# gradients sum over every dp rank's batch (dp <= 4 here)
N = model_reduction_length(moe(), seq=SEQ, tokens=4 * SEQ * BATCH)


# config -----------------------------------------------------------------------------------


def test_dense_by_default() -> None:
    config = model_config("tiny")
    assert not config.is_moe and config.moe_layers == ()
    assert not config.is_moe_layer(0)


def test_which_layers_are_moe() -> None:
    assert moe(num_layers=4).moe_layers == (0, 1, 2, 3)
    assert moe(num_layers=5, moe_layer_freq=2).moe_layers == (0, 2, 4)
    assert moe(num_layers=4, moe_layer_pattern="-EE-").moe_layers == (1, 2)
    assert moe().moe_ffn_size == 32 and moe(moe_ffn_hidden_size=None).moe_ffn_size == 128


def test_registered_moe_configs() -> None:
    mixtral = model_config("mixtral-tiny")
    assert (mixtral.num_experts, mixtral.moe_top_k, mixtral.moe_layers) == (8, 2, (0, 1, 2, 3))
    router = mixtral.moe_config().router
    assert router.score_function == "softmax" and not router.softmax_before_topk
    deepseek = model_config("moe-tiny")
    cfg = deepseek.moe_config()
    assert deepseek.moe_layers == (1, 2, 3)
    assert cfg.router.score_function == "sigmoid" and cfg.router.expert_bias
    assert cfg.router.normalize_topk and cfg.shared_ffn_size == cfg.ffn_hidden_size == 32
    assert cfg.num_experts == 16 and cfg.top_k == 4 and cfg.aux_loss_in_backward


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"num_experts": -1}, "num_experts (-1) must be a non-negative integer; 0 means dense"),
        ({"moe_top_k": 5}, "moe_top_k (5) must be between 1 and num_experts (4); choose"),
        ({"moe_top_k": 0}, "moe_top_k (0) must be between 1 and num_experts (4)"),
        ({"moe_layer_freq": 0}, "moe_layer_freq (0) must be a positive integer"),
        ({"moe_layer_pattern": "EX"}, "moe_layer_pattern ('EX') must have one letter per layer"),
        ({"moe_layer_pattern": "E"}, "moe_layer_pattern ('E') must have one letter per layer (2)"),
        ({"moe_layer_pattern": "--"}, "moe_layer_pattern ('--') has no MoE layer"),
        ({"add_bias": True}, "add_bias is not supported with MoE layers"),
        ({"moe_score_function": "relu"}, "invalid MoE setting: score_function ('relu') must be"),
        ({"moe_num_groups": 3, "moe_group_topk": 1}, "invalid MoE setting: num_experts (4) is not"),
        ({"moe_dispatcher": "p2p"}, "invalid MoE setting: dispatcher ('p2p') must be one of"),
    ],
)
def test_bad_moe_config_is_one_sentence(changes: dict[str, object], expected: str) -> None:
    with pytest.raises(ValueError) as info:
        moe(**changes)
    message = str(info.value)
    assert message.startswith(expected), message
    assert "\n" not in message


# FLOPs ------------------------------------------------------------------------------------


def test_flops_count_only_activated_experts() -> None:
    config = moe(num_layers=3, moe_layer_pattern="E-E", moe_shared_expert_size=64)
    h, layers = config.hidden_size, 3
    dense = config.replace(num_experts=0, moe_layer_pattern=None)
    per_moe = moe_activated_params(h, config.moe_config())
    per_mlp = 3 * h * config.ffn_size
    assert activated_matmul_params(config) == matmul_params(dense) + 2 * (per_moe - per_mlp)
    # router h*E, top-2 of 4 experts (3 h ffn each), one shared expert of 64
    assert per_moe == h * 4 + 2 * 3 * h * 32 + 3 * h * 64
    total = matmul_params(dense) + 2 * (h * 4 + 4 * 3 * h * 32 + 3 * h * 64 - per_mlp)
    assert matmul_params(config) == total
    s = 64
    attention = 4 * s * config.num_attention_heads * config.head_dim * layers
    assert forward_flops_per_token(config, s) == 2 * activated_matmul_params(config) + attention
    assert forward_flops_per_token(dense, s) == 2 * matmul_params(dense) + attention


def _count_weights() -> tuple[int, int]:
    config = moe(num_layers=3, moe_layer_pattern="E-E", moe_shared_expert_size=64)
    model = GPTModel(config, solo_groups(), seed=0, device=rank_device())
    built = sum(
        p.numel()
        for n, p in model.named_parameters()
        if p.dim() >= 2 and not n.startswith("embedding")
    )
    return built, matmul_params(config)


def test_matmul_params_equal_the_built_model(dist_pool: DistPool) -> None:
    built, counted = dist_pool.run(_count_weights, 1)[0]
    assert built == counted


# layouts ----------------------------------------------------------------------------------


def _batch(config: GPTConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _full(model: GPTModel, groups: ProcessGroups, grads: bool) -> dict[str, torch.Tensor]:
    out = {}
    vocab = model.config.vocab_size
    for name, p in model.named_parameters():
        t = p.grad if grads else p.detach()
        assert t is not None, f"{name} has no gradient"
        if expert_shard(p) is not None:
            holder = nn.Parameter(t.detach().clone())
            setattr(holder, EXPERT_ATTR, expert_shard(p))
            t = gather_expert_weight(holder, groups.ep, groups.etp)
        else:
            spec = shard_spec(p)
            if spec is not None and spec.dim is not None and spec.num_shards > 1:
                t = gather_full(t.detach(), spec, groups.tp)
        if name.startswith(("embedding.word", "output")):
            t = t[:vocab]
        out[name] = t.detach().cpu().clone()
    return out


def _compare(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str) -> None:
    assert set(mine) == set(ref), f"{what}: {set(mine) ^ set(ref)}"
    for name, value in mine.items():
        assert_close_to_reference(value, ref[name], reduction_length=N, name=f"{what} {name}")


def _sum_over(model: nn.Module, group: dist.ProcessGroup, experts: bool) -> None:
    for p in model.parameters():
        if p.grad is not None and (expert_shard(p) is not None) == experts:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)


def _layout_contract(
    tp: int, ep: int, etp: int | None, sp: bool, changes: dict[str, object]
) -> None:
    """Each dp rank routes its own batch; gradients summed over dp (experts over edp) equal
    the one-process model's gradients of the summed objective (LM loss + router losses)."""
    config = moe(**changes)
    groups = init_process_groups(ParallelConfig(tp=tp, ep=ep, etp=etp))
    dev = rank_device()
    ref = GPTModel(config, solo_groups(), seed=5, device=dev)
    model = GPTModel(config, groups, sequence_parallel=sp, seed=5, device=dev)
    _compare(_full(model, groups, grads=False), _full(ref, solo_groups(), grads=False), "init")
    dp, dp_rank = groups.size("dp"), groups.rank("dp")
    for d in range(dp):  # the reference sees every dp rank's batch; aux loss weight 1 each
        ids, labels = _batch(config, 7 + d)
        ref_loss = ref(ids.to(dev), labels.to(dev))
        ref_loss.mean().backward()
        if d == dp_rank:
            mine_ref = ref_loss.detach().cpu()
    ids, labels = _batch(config, 7 + dp_rank)
    loss = model(ids.to(dev), labels.to(dev))
    loss.mean().backward()
    assert_close_to_reference(loss, mine_ref, reduction_length=N, name="per-token loss")
    finalize_model_grads(model, groups)
    _sum_over(model, groups.dp, experts=False)
    _sum_over(model, groups.edp, experts=True)
    _compare(_full(model, groups, grads=True), _full(ref, solo_groups(), grads=True), "grad")


LAYOUTS = [
    (1, 2, None, False, {}),  # ep 2 folded over dp 2
    (2, 1, None, True, {"moe_shared_expert_size": 32, "moe_shared_expert_gate": True}),  # etp 2
    (2, 1, 1, False, {"moe_dispatcher": "allgather", "moe_grouped_experts": False}),  # edp = tp
    (2, 2, 1, True, {"moe_score_function": "sigmoid", "moe_normalize_topk": True}),  # ep over tp
]


@pytest.mark.parametrize(
    ("tp", "ep", "etp", "sp", "changes"),
    LAYOUTS,
    ids=["ep2", "tp2-etp2-sp-shared", "tp2-etp1-allgather-sequential", "tp2-ep2-etp1-sp"],
)
def test_moe_gpt_layouts_match_single_process(
    dist_pool: DistPool, tp: int, ep: int, etp: int | None, sp: bool, changes: dict[str, object]
) -> None:
    world = max(tp, ep * (etp or tp))
    dist_pool.run(_layout_contract, world, args=(tp, ep, etp, sp, changes))


def _recompute() -> None:
    config = moe(moe_expert_bias=True, moe_shared_expert_size=32)
    groups = init_process_groups(ParallelConfig(ep=2))
    grads = []
    modes: tuple[Literal["none"], Literal["full"]] = ("none", "full")
    for mode in modes:
        model = GPTModel(config, groups, seed=3, recompute=mode, device=rank_device())
        ids, labels = _batch(config, 7 + dist.get_rank())
        model(ids.to(rank_device()), labels.to(rank_device())).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_full_recompute_of_moe_layers_gives_identical_gradients(dist_pool: DistPool) -> None:
    dist_pool.run(_recompute, 2)


def _router_grad(model: GPTModel) -> torch.Tensor:
    layer = model.layers["0"].mlp
    assert isinstance(layer, MoELayer) and layer.router.weight.grad is not None
    return layer.router.weight.grad.clone()


def _aux_scale() -> None:
    """``aux_loss_scale`` weighs the router losses in backward like a factor on the loss:
    the router's gradient equals that of ``loss + scale * aux`` with the losses added by hand."""
    config = moe()
    dev = rank_device()
    ids, labels = _batch(config, 7)
    grads = []
    for scale in (1.0, 0.25):
        model = GPTModel(config, solo_groups(), seed=3, device=dev)
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        for m in layers:
            m.aux_loss_scale = scale
        loss = model(ids.to(dev), labels.to(dev)).mean()
        aux = torch.stack([m.last_stats.loss for m in layers if m.last_stats is not None]).sum()
        assert float(aux) > 0
        loss.backward()
        grads.append(_router_grad(model))
        ref = GPTModel(config, solo_groups(), seed=3, device=dev)
        ref_layers = [m for m in ref.modules() if isinstance(m, MoELayer)]
        for m in ref_layers:  # the same losses added to the loss by hand instead
            m.config = dataclasses.replace(m.config, aux_loss_in_backward=False)
        ref_loss = ref(ids.to(dev), labels.to(dev)).mean()
        ref_aux = [m.last_stats.loss for m in ref_layers if m.last_stats is not None]
        (ref_loss + scale * torch.stack(ref_aux).sum()).backward()
        # the same operations on one device, only the backward sums grouped differently
        assert_close_to_reference(grads[-1], _router_grad(ref), reduction_length=N,
                                  name=f"aux_loss_scale {scale} router grad")  # fmt: skip
    # and the scale matters: the router losses are a visible part of the router's gradient
    assert not torch.allclose(grads[0], grads[1], rtol=1e-4, atol=0)


def test_router_losses_enter_backward_scaled(dist_pool: DistPool) -> None:
    dist_pool.run(_aux_scale, 1)


def _experts_not_divisible() -> str:
    groups = init_process_groups(ParallelConfig(ep=2))
    try:
        GPTModel(moe(num_experts=3), groups, seed=0, device=rank_device())
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_experts_not_divisible_by_ep_fails_at_construction(dist_pool: DistPool) -> None:
    message = dist_pool.run(_experts_not_divisible, 2)[0]
    assert message.startswith("num_experts (3) is not divisible by ep (2)"), message
    assert "\n" not in message
