"""The heart of mega: GPT training at every parallel layout equals one plain process.

The trainer's parts (mega-models' GPTModel split by tp/SP/cp/pp/vpp, mega-pipeline's
schedules, mega-zero-optim's DDP and distributed optimizer) run 3 optimizer steps on a
tiny GPT (hidden 64, 8 heads, 4 KV heads, 8 layers, vocab 257 — not divisible by tp). The
reference is the same model on one process with plain ``torch.optim.AdamW``, gradient
accumulation over the global batch and ``clip_grad_norm_``. Losses of every step and the
full weights after the last step must agree, and so must every step's gradient norm (the
one clipping uses: a norm that counts a tp copy or a tied weight twice, or misses a shard,
moves Adam's weights too little to show).
"""

from __future__ import annotations

import pytest
import torch
from _reference_cache import reference_once
from _tolerance import forward_reduction_length, model_reduction_length

from mega_models import GPTModel, gather_full_state
from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import (
    DistPool,
    assert_close_to_reference,
    rank_device,
    solo_groups,
)
from mega_pretrain.build import build, gpt_config, parallel_config
from mega_pretrain.config import TrainConfig, load_config
from mega_pretrain.step import StepRunner

STEPS, SEQ, MICRO, GLOBAL = 3, 16, 2, 8
LR = 1e-3
# fp32: layouts reorder float sums; every comparison is ``assert_close_to_reference`` with n
# from ``_chain``: a loss is a forward quantity (the forward chain), a gradient norm a sum of
# squares of one step's gradients (the gradient chain). Adam divides each gradient by its
# own RMS, so after 3 steps a weight moves by ~3*lr = 3e-3; a nearly cancelling gradient's
# rounding enters its update as lr * dg / eps, which is not proportional to the update
# (measured: 20 times u · sqrt(n) · STEPS * LR on a tied embedding), so the weights are
# compared at their own scale with n the gradient chain of all steps, while a wrong or
# missing gradient moves a weight by ~lr = 1e-3.
# Adam's eps is 1e-5 here, not 1e-8: for a weight whose gradient nearly cancels (|g| ~ 1e-9)
# Adam's first update is lr * g / |g|, so rounding noise in g could flip its sign and move
# the weight by 2 * lr in one layout and not the other; with eps = 1e-5 such updates are
# lr * g / eps, proportional to g again, and every weight's rounding stays ~1e-9.
EPS = 1e-5


def _chain(model: dict[str, object]) -> tuple[int, int]:
    """(forward, one step's gradient) reduction lengths of the model, counted as the models'
    contract tests count them (``_tolerance``): a weight gradient sums over the global batch."""
    gpt = gpt_config(load_config(None, _overrides({}, model)))
    forward = forward_reduction_length(gpt, seq=SEQ)
    return forward, model_reduction_length(gpt, seq=SEQ, tokens=GLOBAL * SEQ)


def _micro(layout: dict[str, object]) -> int:
    """Micro-batch size: 1 where interleaving over pp=4 needs 4 micro-batches per dp rank."""
    return 1 if layout.get("pp") == 4 else MICRO


def _overrides(layout: dict[str, object], model: dict[str, object]) -> list[tuple[str, str]]:
    out = [
        ("train.seq_len", str(SEQ)), ("train.micro_batch_size", str(_micro(layout))),
        ("train.global_batch_size", str(GLOBAL)), ("train.lr", str(LR)), ("train.min_lr", str(LR)),
        ("train.warmup_steps", "0"), ("train.decay", "constant"), ("train.clip_grad", "1.0"),
        ("parallel.bucket_size", "1000"), ("train.eps", str(EPS)),
    ]  # fmt: skip
    out += [
        (f"parallel.{k}", str(v).lower() if isinstance(v, bool) else str(v))
        for k, v in layout.items()
    ]
    out += [
        (f"model.{k}", str(v).lower() if isinstance(v, bool) else str(v)) for k, v in model.items()
    ]
    return out


def _batches(seed: int, step: int, micro: int = MICRO) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of a step, cut into micro-batches (the same samples for any size)."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    tokens = torch.randint(0, 257, (GLOBAL, SEQ + 1), generator=gen)
    return [
        (tokens[i : i + micro, :-1], tokens[i : i + micro, 1:]) for i in range(0, GLOBAL, micro)
    ]


def _full_weights(chunks: list[GPTModel]) -> dict[str, torch.Tensor]:
    """Every weight unsplit over tp, vocab padding cut (no pp group: this stage's layers)."""
    state = gather_full_state(chunks)
    assert state is not None
    return {name: t.float() for name, t in state.items()}


def _reference_adamw(net: torch.nn.Module, t: TrainConfig) -> torch.optim.AdamW:
    """Plain AdamW with the trainer's groups: matrices decayed, vectors (norms, biases) not."""
    decay = [p for p in net.parameters() if p.dim() >= 2]
    no_decay = [p for p in net.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, betas=(t.beta1, t.beta2), eps=t.eps,
    )  # fmt: skip


def _reference(
    model: dict[str, object],
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    config = load_config(None, _overrides({}, model))
    gpt = gpt_config(config)
    dev = rank_device()
    net = GPTModel(gpt, solo_groups(), seed=config.train.seed, device=dev)
    t = config.train
    opt = _reference_adamw(net, t)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        batches = _batches(7, step)
        for tokens, labels in batches:
            loss = net(tokens.to(dev), labels.to(dev)).mean() / len(batches)
            loss.backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), t.clip_grad)))
        opt.step()
        losses.append(total)
    assert min(norms) > t.clip_grad, "clipping must act for the norm to matter"
    return losses, norms, _full_weights([net])


def _parallel(
    layout: dict[str, object], model: dict[str, object]
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    config = load_config(None, _overrides(layout, model))
    groups = init_process_groups(parallel_config(config))
    dev = rank_device()
    built = build(config, groups, dev)
    gpt = gpt_config(config)
    micro = _micro(layout)
    runner = StepRunner(
        built, groups, seq_len=SEQ, micro_batch_size=micro, hidden_size=gpt.hidden_size,
        dtype=torch.float32, device=dev, sequence_parallel=config.parallel.sequence_parallel,
    )  # fmt: skip
    dp, dp_rank = groups.size("dp"), groups.rank("dp")
    losses, norms = [], []
    for step in range(STEPS):
        mine = _batches(7, step, micro)[dp_rank::dp]  # this dp rank's micro-batches
        loss, result = runner.train_step(mine, LR)
        losses.append(float(loss))
        norms.append(float(result.grad_norm or 0.0))
    for ddp in built.ddps:  # overlap_param_gather: the last step's gathers are still in flight
        ddp.finish_param_sync()
    weights = _full_weights(built.chunks)
    return losses, norms, weights


def _check(
    dist_pool: DistPool, layout: dict[str, object], model: dict[str, object], dp: int
) -> None:
    reference = reference_once(dist_pool, _reference, model)
    _assert_matches(
        dist_pool.run(_parallel, _world(layout, dp), args=(layout, model)), reference, model
    )


Result = tuple[list[float], list[float], dict[str, torch.Tensor]]


def _assert_matches(results: list[Result], reference: Result, model: dict[str, object]) -> None:
    """Every rank's losses and grad norms, and the merged weights of its stages, equal the
    reference's to the rounding of the model's reduction chains."""
    ref_losses, ref_norms, ref_weights = reference
    forward, grad = _chain(model)
    for losses, norms, _ in results:  # every rank logs the same global-batch loss and norm
        assert_close_to_reference(
            torch.tensor(losses), torch.tensor(ref_losses), reduction_length=forward, name="losses"
        )
        assert_close_to_reference(
            torch.tensor(norms), torch.tensor(ref_norms), reduction_length=grad, name="grad norms"
        )
    merged: dict[str, torch.Tensor] = {}
    for _, _, weights in results:  # each pipeline stage returns its own layers
        merged.update(weights)
    assert set(merged) == set(ref_weights)
    for name, value in merged.items():
        assert_close_to_reference(
            value, ref_weights[name], reduction_length=STEPS * grad, name=name
        )


LAYOUTS = [
    {"tp": 2},
    {"tp": 2, "sequence_parallel": True},
    {"tp": 4, "sequence_parallel": True},
    {"pp": 2},
    {"pp": 2, "vpp": 2},
    {"pp": 4},
    {"pp": 4, "vpp": 2},
    {"cp": 2},
    {"tp": 2, "pp": 2, "sequence_parallel": True},
    {"tp": 2, "pp": 2, "vpp": 2},
    {"tp": 2, "pp": 2, "distributed_optimizer": False, "overlap_grad_reduce": False},
    {"tp": 2, "overlap_param_gather": True},
    {"tp": 2, "cp": 2, "sequence_parallel": True},
    {"pp": 2, "cp": 2},
    {"pp": 2, "pp_layers": "5,3"},  # uneven: the last stage also holds the head and loss
    {"pp": 2, "vpp": 2, "pp_layers": "1,3,2,2"},
]


def _world(layout: dict[str, object], dp: int) -> int:
    return int(layout.get("tp", 1)) * int(layout.get("pp", 1)) * int(layout.get("cp", 1)) * dp  # type: ignore[call-overload]


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_training_matches_single_process(
    dist_pool: DistPool, layout: dict[str, object], dp: int
) -> None:
    assert _world(layout, dp) <= 8
    _check(dist_pool, layout, {}, dp)


MODEL_CASES = [
    ({"pp": 2}, {"tie_embeddings": True}, 2),
    ({"pp": 2}, {"tie_embeddings": True, "position": "learned"}, 2),
    ({"tp": 2, "pp": 2, "sequence_parallel": True}, {"tie_embeddings": True, "qk_norm": True}, 2),
    (
        {"tp": 2, "cp": 2},
        {"norm": "layernorm", "activation": "gelu", "position": "learned", "add_bias": True},
        1,
    ),
]


@pytest.mark.parametrize(
    ("layout", "model", "dp"),
    MODEL_CASES,
    ids=[
        "tied-pp2-dp2",
        "tied-learned-pp2-dp2",
        "tied-qknorm-tp2-pp2-sp-dp2",
        "layernorm-gelu-learned-bias-tp2-cp2",
    ],
)
def test_model_variants_match_single_process(
    dist_pool: DistPool, layout: dict[str, object], model: dict[str, object], dp: int
) -> None:
    _check(dist_pool, layout, model, dp)
