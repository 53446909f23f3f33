"""Document-aware packing trains the same at every layout as on one process.

``data.reset_position_ids``, ``data.reset_attention_mask`` and ``data.eod_mask_loss`` all on;
3 AdamW steps of test_gpt_training_layouts' tiny GPT (its settings, tolerances and
helpers) on batches whose samples pack documents of varying lengths, so the number of
counted positions differs between micro-batches and dp ranks. The reference is one plain
process: each micro-batch's per-token loss summed over the positions whose input is not an
EOD, divided by the count of the whole global batch, accumulated; the positions restart
and attention stays inside each document. The layouts must agree on every step's loss
(the mean over the global batch's counted positions), gradient norm and the final weights.
"""

from __future__ import annotations

import pytest
import torch
from test_gpt_training_layouts import (
    GLOBAL,
    LR,
    SEQ,
    STEPS,
    _assert_matches,
    _full_weights,
    _micro,
    _overrides,
    _reference_adamw,
    _world,
)

from mega_models import GPTModel
from mega_models.doc_mask import DocumentPacking, loss_mask
from mega_parallel_grid import init_process_groups
from mega_parallel_grid.testing import (
    DistPool,
    rank_device,
    solo_groups,
)
from mega_pretrain.build import build, gpt_config, parallel_config
from mega_pretrain.config import load_config
from mega_pretrain.step import StepRunner

EOD = 256  # the byte tokenizer's
SWITCHES = [("data.reset_position_ids", "true"), ("data.reset_attention_mask", "true"),
            ("data.eod_mask_loss", "true")]  # fmt: skip


def _packed_batches(step: int, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of a step with EODs at random places (about one in 5 tokens, more
    in some samples), cut into micro-batches."""
    gen = torch.Generator().manual_seed(70 + step)
    tokens = torch.randint(0, EOD, (GLOBAL, SEQ + 1), generator=gen)
    rate = torch.linspace(0.05, 0.4, GLOBAL)[:, None]
    tokens[torch.rand(GLOBAL, SEQ + 1, generator=gen) < rate] = EOD
    return [
        (tokens[i : i + micro, :-1], tokens[i : i + micro, 1:]) for i in range(0, GLOBAL, micro)
    ]


def _reference(
    model: dict[str, object],
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    config = load_config(None, _overrides({}, model) + SWITCHES)
    gpt = gpt_config(config)
    dev = rank_device()
    net = GPTModel(gpt, solo_groups(), seed=config.train.seed, device=dev)
    packing = DocumentPacking(EOD, True, True, True)
    t = config.train
    opt = _reference_adamw(net, t)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        batches = _packed_batches(step, GLOBAL)
        count = sum(int(loss_mask(tokens, EOD).sum()) for tokens, _ in batches)
        total = 0.0
        for tokens, labels in batches:
            tokens, labels = tokens.to(dev), labels.to(dev)
            per_token = net(tokens, labels, documents=packing.documents(tokens))
            loss = per_token[loss_mask(tokens, EOD)].sum() / count
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
    config = load_config(None, _overrides(layout, model) + SWITCHES)
    groups = init_process_groups(parallel_config(config))
    dev = rank_device()
    built = build(config, groups, dev)
    assert built.packing == DocumentPacking(EOD, True, True, True)
    micro = _micro(layout)
    runner = StepRunner(
        built, groups, seq_len=SEQ, micro_batch_size=micro,
        hidden_size=gpt_config(config).hidden_size, dtype=torch.float32, device=dev,
        sequence_parallel=config.parallel.sequence_parallel,
    )  # fmt: skip
    dp, dp_rank = groups.size("dp"), groups.rank("dp")
    losses, norms = [], []
    for step in range(STEPS):
        loss, result = runner.train_step(_packed_batches(step, micro)[dp_rank::dp], LR)
        losses.append(float(loss))
        norms.append(float(result.grad_norm or 0.0))
    return losses, norms, _full_weights(built.chunks)


CASES = [
    ({"tp": 2, "sequence_parallel": True}, {}, 1),
    ({"pp": 2}, {}, 1),
    ({}, {}, 2),
    ({"cp": 2, "cp_method": "all_gather"}, {}, 1),
    (
        {"tp": 2, "sequence_parallel": True},
        {
            "attention": "mla",
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4,
            "v_head_dim": 8,
            "num_query_groups": 8,
        },
        1,
    ),
]


@pytest.mark.parametrize(
    ("layout", "model", "dp"), CASES, ids=["tp2-sp", "pp2", "dp2", "cp2-all_gather", "mla-tp2-sp"]
)
def test_packed_training_matches_single_process(
    dist_pool: DistPool, layout: dict[str, object], model: dict[str, object], dp: int
) -> None:
    reference = dist_pool.run(_reference, 1, args=(model,))[0]
    _assert_matches(
        dist_pool.run(_parallel, _world(layout, dp), args=(layout, model)), reference, model
    )
