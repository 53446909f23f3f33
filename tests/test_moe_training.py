"""A tiny MoE GPT trains through the trainer at ep x dp, ep x tp, ep x pp, ep x cp like one process.

The trainer's parts (GPTModel with MoE layers split over ep/etp/tp/pp/cp, mega-pipeline's
schedule, two mega-zero-optim DDPs — dense weights averaged over dp x cp, expert weights
summed over the expert data-parallel group and scaled by 1/(dp x cp) — and one
distributed optimizer whose gradient norm counts every expert shard once) run 3 AdamW
steps on a Mixtral-style model: 2 layers, hidden 32, 4 experts, top-2, no token dropping,
a switch aux loss and a z-loss. A DeepSeek-style variant adds sigmoid group-limited
routing, a shared expert, a sequence-level loss and the aux-loss-free expert bias (updated
after every step). The reference is the same model in one plain process:
``torch.optim.AdamW``, gradient accumulation over the global batch's micro-batches (each
micro-batch's loss is its mean language-model loss plus its router losses),
``clip_grad_norm_``. Losses and gradient norms of every step, the full weights after the last
step (experts gathered over ep and etp) and the logged router loss and expert load must agree;
the clip value is below every step's norm, so every step clips by the norm compared (which
must count every expert shard once and every tp replica once).
"""

from __future__ import annotations

import pytest
import torch
from _reference_cache import reference_once
from _tolerance import forward_reduction_length, model_reduction_length

from mega_models import GPTConfig, GPTModel, gather_full_state
from mega_moe import MoELayer, update_expert_biases
from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import (
    DistPool,
    assert_close_to_reference,
    rank_device,
    solo_groups,
)
from mega_pretrain.build import build, gpt_config, parallel_config
from mega_pretrain.config import load_config
from mega_pretrain.moe_logging import moe_log_values
from mega_pretrain.step import StepRunner
from mega_pretrain.validate import check_config

STEPS, SEQ, MICRO, GLOBAL = 3, 16, 2, 8
LR = 1e-3
# Tolerances and Adam's eps as in test_gpt_training_layouts.py: fp32 layouts reorder float
# sums; ``assert_close_to_reference`` with n from ``_chain`` (forward for losses, one step's
# gradients for norms, all steps' for weights, at the weights' own scale), while
# a wrong or missing gradient (or a wrong aux-loss or expert-gradient scale) moves a weight
# by ~lr = 1e-3. eps = 1e-5 keeps Adam's
# first update proportional to a nearly cancelling gradient instead of lr * sign(noise).
EPS = 1e-5
# The gradient norm is an fp32 sum of squares of one step's gradients, reduced in another
# order: the gradient chain's bound (~4e-5 relative here). The experts' and the
# tp-replicated norm weights' gradients are small here, yet a norm leaving the experts out
# is off by ~8e-4 relative, one counting the norm weights twice by ~1e-4: both outside it.
# (Adam hardly sees a clip factor off by that much, so the weights alone would not catch
# either.)
# Below every reference step's norm (asserted there), so that every step clips.
CLIP = 0.5

MIXTRAL = {
    "hidden_size": 32, "num_layers": 2, "num_attention_heads": 4, "num_query_groups": 2,
    "num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 64, "moe_aux_loss_coeff": 0.01,
    "moe_z_loss_coeff": 0.001,
}  # fmt: skip
DEEPSEEK = {
    **MIXTRAL, "moe_aux_loss_coeff": 0.0, "moe_score_function": "sigmoid",
    "moe_normalize_topk": True, "moe_num_groups": 2, "moe_group_topk": 1,
    "moe_shared_expert_size": 32, "moe_seq_aux_loss_coeff": 0.01, "moe_expert_bias": True,
    "moe_bias_update_rate": 0.01, "moe_grouped_experts": False,
}  # fmt: skip
# At scale (issue 12): enough experts for ep4 and ep8 to hold several each. Mixtral-style with
# 16 experts, top-2, the all-to-all dispatcher and grouped experts (both MIXTRAL's defaults);
# DeepSeek-style fine-grained: 16 small experts, top-6 from the best 2 of 4 groups.
MIXTRAL_16 = {**MIXTRAL, "num_experts": 16}
DEEPSEEK_16 = {
    **DEEPSEEK, "num_experts": 16, "moe_top_k": 6, "moe_ffn_hidden_size": 16,
    "moe_num_groups": 4, "moe_group_topk": 2,
}  # fmt: skip


def _chain(model: dict[str, object]) -> tuple[int, int]:
    """(forward, one step's gradient) reduction lengths of the model, counted as the models'
    contract tests count them (``_tolerance``): a weight gradient sums over the global batch."""
    gpt = gpt_config(load_config(None, _overrides({}, model)))
    forward = forward_reduction_length(gpt, seq=SEQ)
    return forward, model_reduction_length(gpt, seq=SEQ, tokens=GLOBAL * SEQ)


def _overrides(
    layout: dict[str, object], model: dict[str, object], micro: int = MICRO
) -> list[tuple[str, str]]:
    out = [
        ("model.size", "mixtral-tiny"), ("train.seq_len", str(SEQ)),
        ("train.micro_batch_size", str(micro)), ("train.global_batch_size", str(GLOBAL)),
        ("train.lr", str(LR)), ("train.min_lr", str(LR)), ("train.warmup_steps", "0"),
        ("train.decay", "constant"), ("train.clip_grad", str(CLIP)), ("parallel.bucket_size", "1000"),
        ("train.eps", str(EPS)),
    ]  # fmt: skip
    out += [
        (f"parallel.{k}", str(v).lower() if isinstance(v, bool) else str(v))
        for k, v in layout.items()
    ]
    out += [
        (f"model.{k}", str(v).lower() if isinstance(v, bool) else str(v)) for k, v in model.items()
    ]
    return out


def _batches(seed: int, step: int, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of a step, cut into micro-batches."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    tokens = torch.randint(0, 257, (GLOBAL, SEQ + 1), generator=gen)
    return [
        (tokens[i : i + micro, :-1], tokens[i : i + micro, 1:]) for i in range(0, GLOBAL, micro)
    ]


def _full_weights(chunks: list[GPTModel]) -> dict[str, torch.Tensor]:
    """Every weight unsplit (experts over ep and etp, the rest over tp; vocab padding cut)."""
    state = gather_full_state(chunks)  # no pp group: this stage's layers
    assert state is not None
    return {name: t.float() for name, t in state.items()}


def _moe_layers(model: torch.nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


Stats = tuple[torch.Tensor, float]  # per-layer tokens per expert [L, E], router loss summed


def _stats(net: GPTModel) -> Stats:
    layers = _moe_layers(net)
    counts = torch.stack([m.last_stats.tokens_per_expert.cpu() for m in layers if m.last_stats])
    return counts.double(), float(sum(float(m.last_stats.loss) for m in layers if m.last_stats))


Run = tuple[list[float], list[float], dict[str, torch.Tensor]]  # losses, grad norms, weights


def _reference(model: dict[str, object], micro: int = MICRO) -> tuple[Run, list[Stats]]:
    config = load_config(None, _overrides({}, model, micro))
    gpt = gpt_config(config)
    dev = rank_device()
    net = GPTModel(gpt, solo_groups(), seed=config.train.seed, device=dev)
    decay = [p for p in net.parameters() if p.dim() >= 2]
    no_decay = [p for p in net.parameters() if p.dim() < 2]
    t = config.train
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, betas=(t.beta1, t.beta2), eps=t.eps,
    )  # fmt: skip
    losses: list[float] = []
    norms: list[float] = []
    stats: list[Stats] = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        batches = _batches(7, step, micro)
        for layer in _moe_layers(net):  # the router losses weigh like the LM loss: 1/m
            layer.aux_loss_scale = 1.0 / len(batches)
        stats = []
        for tokens, labels in batches:
            loss = net(tokens.to(dev), labels.to(dev)).mean() / len(batches)
            loss.backward()  # + the router losses' gradient, inside the MoE layers
            total += float(loss.detach())
            stats.append(_stats(net))
        norm = float(torch.nn.utils.clip_grad_norm_(net.parameters(), t.clip_grad))
        assert norm > t.clip_grad, f"step {step}: norm {norm} <= {t.clip_grad}, no clipping"
        norms.append(norm)
        opt.step()
        update_expert_biases(net)
        losses.append(total)
    return (losses, norms, _full_weights([net])), stats


def _parallel(
    layout: dict[str, object], model: dict[str, object], micro: int = MICRO
) -> tuple[Run, dict[str, float]]:
    config = load_config(None, _overrides(layout, model, micro))
    gpt = gpt_config(config)
    check_config(config, gpt, torch.distributed.get_world_size())
    groups = init_process_groups(parallel_config(config))
    dev = rank_device()
    built = build(config, groups, dev)
    assert built.expert_ddp is not None
    runner = StepRunner(
        built, groups, seq_len=SEQ, micro_batch_size=micro, hidden_size=gpt.hidden_size,
        dtype=torch.float32, device=dev, sequence_parallel=config.parallel.sequence_parallel,
    )  # fmt: skip
    dp, dp_rank = groups.size("dp"), groups.rank("dp")
    losses, norms = [], []
    for step in range(STEPS):
        mine = _batches(7, step, micro)[dp_rank::dp]  # this dp rank's micro-batches
        loss, result = runner.train_step(mine, LR)
        assert result.updated
        losses.append(float(loss))
        norms.append(result.grad_norm)
    logged = moe_log_values(built.chunks, groups)
    return (losses, norms, _full_weights(built.chunks)), logged


def _expected_log(stats: list[Stats], dp: int) -> dict[str, float]:
    """What the trainer logs: the last micro-batch of every dp rank, summed over dp."""
    last = [len(stats) - dp + d for d in range(dp)]  # dp rank d runs micro-batches d, d+dp, ...
    counts = sum(stats[i][0] for i in last)
    assert isinstance(counts, torch.Tensor)
    shares = counts / counts.sum(dim=1, keepdim=True)
    return {
        "moe_aux_loss": sum(stats[i][1] for i in last) / dp,
        "moe_load_min": float(shares.min()),
        "moe_load_max": float(shares.max()),
        "moe_imbalance": float(shares.max(dim=1).values.max() * counts.shape[1]),
    }


def _world(layout: dict[str, object], dp: int) -> int:
    sizes = [int(str(layout.get(k, 1))) for k in ("tp", "pp", "cp")]
    return sizes[0] * sizes[1] * sizes[2] * dp


def _check(
    dist_pool: DistPool,
    layout: dict[str, object],
    model: dict[str, object],
    dp: int,
    micro: int = MICRO,
) -> None:
    (ref_losses, ref_norms, ref_weights), ref_stats = reference_once(
        dist_pool, _reference, model, micro
    )
    results = dist_pool.run(_parallel, _world(layout, dp), args=(layout, model, micro))
    expected_log = _expected_log(ref_stats, dp)
    forward, grad = _chain(model)
    for (losses, norms, _), logged in results:  # every rank logs the same global-batch values
        assert_close_to_reference(
            torch.tensor(losses), torch.tensor(ref_losses), reduction_length=forward, name="losses"
        )
        assert_close_to_reference(
            torch.tensor(norms), torch.tensor(ref_norms), reduction_length=grad, name="grad norm"
        )
        assert logged.keys() == expected_log.keys()
        for key, got in logged.items():  # loads are exact counts; the loss an fp32 sum
            assert_close_to_reference(
                torch.tensor(got), torch.tensor(expected_log[key]), reduction_length=forward,
                name=key,
            )  # fmt: skip
    merged: dict[str, torch.Tensor] = {}
    for (_, _, weights), _ in results:  # each pipeline stage returns its own layers
        merged.update(weights)
    assert set(merged) == set(ref_weights)
    for name, value in merged.items():
        assert_close_to_reference(
            value, ref_weights[name], reduction_length=STEPS * grad, name=name
        )


CASES = [
    ({"ep": 2}, MIXTRAL, 4),  # ep2·dp2: ep folded over dp, experts summed over edp = 2
    ({"ep": 2, "tp": 2}, MIXTRAL, 2),  # ep2·tp2: etp = tp = 2, edp = 1
    ({"ep": 2, "tp": 2, "etp": 1, "sequence_parallel": True}, DEEPSEEK, 2),
    ({"ep": 2, "pp": 2}, MIXTRAL, 2),  # router losses of the first stage enter its backward
    ({"ep": 2, "cp": 2}, DEEPSEEK, 2),  # router losses over tp x cp, DDP mean over cp
]


@pytest.mark.parametrize(
    ("layout", "model", "dp"),
    CASES,
    ids=["ep2-dp2", "ep2-tp2", "ep2-tp2-etp1-sp-deepseek", "ep2-pp2", "ep2-cp2-deepseek"],
)
def test_moe_training_matches_single_process(
    dist_pool: DistPool, layout: dict[str, object], model: dict[str, object], dp: int
) -> None:
    _check(dist_pool, layout, model, dp)


# Expert parallel at scale (issue 12): 4 and 8 ranks. At dp8 the global batch of 8 sequences is
# cut into micro-batches of 1 so that every dp rank gets one.
SCALE_CASES = [
    ({"ep": 4}, MIXTRAL_16, 4, MICRO),  # ep4 folded over dp4: 4 experts a rank, edp = 1
    ({"ep": 8}, MIXTRAL_16, 8, 1),  # ep8 folded over dp8: 2 experts a rank
    ({"ep": 8, "tp": 2, "etp": 1}, DEEPSEEK_16, 4, MICRO),  # ep8 over tp2·dp4: etp1, edp = 1
]


@pytest.mark.parametrize(
    ("layout", "model", "dp", "micro"),
    SCALE_CASES,
    ids=["ep4-dp4", "ep8-dp8", "ep8-tp2-etp1-deepseek"],
)
def test_moe_training_at_scale_matches_single_process(
    dist_pool: DistPool, layout: dict[str, object], model: dict[str, object], dp: int, micro: int
) -> None:
    _check(dist_pool, layout, model, dp, micro)


def _message(layout: dict[str, object], model: dict[str, object], world: int, seq: int) -> str:
    config = load_config(None, [*_overrides(layout, model), ("train.seq_len", str(seq))])
    try:
        check_config(config, gpt_config(config), world)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("layout", "model", "world", "seq", "expected"),
    [
        ({"ep": 4}, {"num_experts": 6}, 4, SEQ, "model.num_experts (6) is not divisible by ep (4)"),
        (
            {"tp": 2, "etp": 2},
            {"moe_ffn_hidden_size": 33},
            2,
            SEQ,
            "the expert FFN size (model.moe_ffn_hidden_size, 33) is not divisible by etp (2)",
        ),
        (
            {"tp": 2},
            {"moe_shared_expert_size": 33},
            2,
            SEQ,
            "model.moe_shared_expert_size (33) is not divisible by tp (2)",
        ),
        ({"ep": 2}, {"num_experts": 0}, 2, SEQ, "ep (2) > 1 needs an MoE model"),
        ({"tp": 4}, {}, 4, 18, "MoE layers split each cp rank's sequence (18 tokens) over tp (4)"),
    ],
    ids=["experts-ep", "ffn-etp", "shared-tp", "ep-dense", "seq-tp"],
)
def test_bad_moe_layout_fails_at_config_time(
    layout: dict[str, object], model: dict[str, object], world: int, seq: int, expected: str
) -> None:
    message = _message(layout, model, world, seq)
    assert message.startswith(expected), message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"num_experts": 4, "moe_top_k": 5}, "moe_top_k (5) must be between 1 and num_experts (4)"),
        ({"moe_layer_pattern": "E-E"}, "moe_layer_pattern ('E-E') must have one letter per layer"),
        ({"add_bias": True}, "add_bias is not supported with MoE layers"),
        ({"moe_capacity_factor": -1.0}, "invalid MoE setting: capacity_factor (-1.0) must be > 0"),
    ],
    ids=["top-k", "pattern", "bias", "router"],
)
def test_bad_moe_model_fails_in_gpt_config(changes: dict[str, object], expected: str) -> None:
    with pytest.raises(ValueError) as info:
        GPTConfig(**{**MIXTRAL, **changes})  # type: ignore[arg-type]
    assert str(info.value).startswith(expected), str(info.value)
    assert "\n" not in str(info.value)
