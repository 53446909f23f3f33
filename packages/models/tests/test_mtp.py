"""Multi-token prediction on one process: the loss, its gradients, dropping it, bad input.

The reference re-computes every depth from the model's own modules by truncation instead
of masking: depth k at position t sees tokens up to t + k only (causal attention), so
running it on the first s - k positions with targets ``labels[:, k:]`` is the plain
computation of the masked mean the model takes over the ``b * (s - k)`` positions that
have a target. Both run the same kernels on other shapes, so they agree to rounding:
``assert_close_to_reference`` with the reduction length of the model and its depths.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _tolerance import model_reduction_length
from torch import Tensor

from mega_models import GPTConfig, GPTModel, model_config, mtp_labels, spec_for
from mega_models.mtp_flops import mtp_flops_per_token, mtp_matmul_params, mtp_norm_params
from mega_models.rope import rope_for
from mega_models.spec import LayoutRequest
from mega_moe import MoELayer
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, solo_groups

SEQ, BATCH = 12, 2
BASE = GPTConfig(vocab_size=97, hidden_size=32, num_layers=2, num_attention_heads=4,
                 num_query_groups=2, ffn_hidden_size=64)  # fmt: skip


def _data(vocab: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(5)
    seq = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


def _run_layer(layer: torch.nn.Module, x: Tensor, c: GPTConfig) -> Tensor:
    s = x.shape[0]
    rope = rope_for(c, torch.arange(s), x.dtype)
    out: Tensor = layer(x, rope, s)
    return out


def _plain(model: GPTModel, tokens: Tensor, labels: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Main loss and each depth's loss, from the model's modules, by truncation."""
    c = model.config
    assert model.embedding is not None and model.final_norm is not None and model.mtp is not None
    word = model.embedding.word

    def head(norm: torch.nn.Module, h: Tensor, targets: Tensor) -> Tensor:
        w = model.output.weight if model.output is not None else word.weight
        logits = F.linear(norm(h), w)[..., : c.vocab_size]  # [s, b, V]
        return F.cross_entropy(logits.flatten(0, 1), targets.t().flatten())

    h = word(tokens.t())
    for layer in model.layers.values():
        h = _run_layer(layer, h, c)
    main = head(model.final_norm, h, labels)
    losses = []
    for k, depth in enumerate(model.mtp, start=1):
        n = SEQ - k
        x = depth.eh_proj(torch.cat([depth.enorm(word(tokens[:, k:].t())), depth.hnorm(h[:n])], -1))
        h = _run_layer(depth.layer, x, c)
        losses.append(head(depth.final_norm, h, labels[:, k:]))
    return main, losses


def _grads(model: GPTModel, loss: Tensor) -> dict[str, Tensor]:
    model.zero_grad()
    loss.backward(retain_graph=True)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


#: deepseek-v3-tiny's MLA and MoE (its sequence-level router loss off: truncating a sequence
#: changes that loss, not the language-model losses compared here)
DEEPSEEK = {"size": "deepseek-v3-tiny", "moe_seq_aux_loss_coeff": 0.0}


def _config(changes: dict[str, object]) -> GPTConfig:
    rest = {k: v for k, v in changes.items() if k != "size"}
    base = model_config(str(changes["size"])) if "size" in changes else BASE
    return base.replace(**rest)


def _check_loss_and_grads(changes: dict[str, object]) -> None:
    c = _config(changes)
    model = GPTModel(c, solo_groups(), seed=3)
    tokens, labels = _data(c.vocab_size)
    per_token = model(tokens, labels)
    assert per_token.shape == (BATCH, SEQ)
    assert model.mtp_losses is not None
    got_losses = model.mtp_losses.clone()
    got = _grads(model, per_token.mean())
    main, losses = _plain(model, tokens, labels)
    total = main + c.mtp_loss_scale * torch.stack(losses).mean()
    n = model_reduction_length(c, seq=SEQ, tokens=BATCH * SEQ)  # the depths count as layers
    assert_close_to_reference(per_token.mean(), main, reduction_length=n, name="main loss")
    assert_close_to_reference(got_losses, torch.stack(losses).detach(), reduction_length=n,
                              name="mtp losses")  # fmt: skip
    main_only = _grads(model, main)
    want = _grads(model, total)
    assert got.keys() == want.keys()
    assert any(name.startswith("mtp.") for name in got)
    for name, grad in got.items():
        assert_close_to_reference(grad, want[name], reduction_length=n, name=name)
    # the shared embedding and head get the depths' gradient on top of the main loss's
    head = "embedding.word.weight" if c.tie_embeddings else "output.weight"
    for name in ("embedding.word.weight", head):
        assert (got[name] - main_only[name]).abs().max() > 1e-2 * got[name].abs().max(), name


@pytest.mark.parametrize(
    "changes",
    [
        {"mtp_num_layers": 1},
        {"mtp_num_layers": 2, "tie_embeddings": True, "mtp_loss_scale": 0.3},
        DEEPSEEK,
    ],
    ids=["D1", "D2-tied", "deepseek-v3-tiny-mla-moe"],
)
def test_mtp_loss_and_grads_equal_plain_recomputation(
    dist_pool: DistPool, changes: dict[str, object]
) -> None:
    dist_pool.run(_check_loss_and_grads, 1, args=(changes,))


def _check_drop() -> None:
    tokens, labels = _data(BASE.vocab_size)
    plain = GPTModel(BASE, solo_groups(), seed=3)
    with_mtp = GPTModel(BASE.replace(mtp_num_layers=2), solo_groups(), seed=3)
    dropped = GPTModel(BASE.replace(mtp_num_layers=2), solo_groups(), seed=3, mtp=False)
    assert dropped.mtp is None and dropped.mtp_depth == 0 and not dropped.shared_embedding
    assert not any(n.startswith("mtp.") for n, _ in dropped.named_parameters())
    want = dict(plain.named_parameters())
    for name, p in dropped.named_parameters():  # the same main weights, by name
        assert torch.equal(p, want[name]), name
    logits = plain(tokens)
    assert torch.equal(dropped(tokens), logits)
    assert torch.equal(with_mtp(tokens), logits)  # no labels: the main logits only
    assert torch.equal(dropped(tokens, labels), plain(tokens, labels))


def test_dropping_mtp_gives_the_plain_gpt(dist_pool: DistPool) -> None:
    dist_pool.run(_check_drop, 1)


def test_moe_model_gets_an_moe_mtp_layer(dist_pool: DistPool) -> None:
    dist_pool.run(_check_moe_kind, 1)


def _check_moe_kind() -> None:
    moe = BASE.replace(num_experts=4, moe_top_k=2, moe_layer_pattern="-E", mtp_num_layers=1)
    model = GPTModel(moe, solo_groups(), seed=3)
    assert model.mtp is not None and isinstance(model.mtp[0].layer.mlp, MoELayer)
    dense_last = moe.replace(moe_layer_pattern="E-")
    model = GPTModel(dense_last, solo_groups(), seed=3)
    assert model.mtp is not None and not isinstance(model.mtp[0].layer.mlp, MoELayer)


def test_mtp_labels_shift_and_mask() -> None:
    labels = torch.arange(10).view(2, 5)
    rows = mtp_labels(labels, 2)
    assert rows.shape == (3, 2, 5)
    assert rows[0].tolist() == labels.tolist()
    assert rows[2].tolist() == [[2, 3, 4, -100, -100], [7, 8, 9, -100, -100]]


def _message(kind: str) -> str:
    groups = init_process_groups(ParallelConfig(cp=2)) if kind == "cp" else solo_groups()
    c = BASE.replace(mtp_num_layers=2)
    try:
        if kind == "learned":
            GPTModel(c.replace(position="learned"), groups)
        elif kind == "short":
            GPTModel(c, groups)(
                torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long)
            )
        elif kind == "cp":
            local = torch.zeros(1, 4, dtype=torch.long)
            GPTModel(c, groups)(local, local)
        elif kind == "rows":
            GPTModel(c, groups)(
                torch.zeros(1, 4, dtype=torch.long), torch.zeros(2, 1, 4, dtype=torch.long)
            )
        elif kind == "layout":
            request = LayoutRequest(parallel=ParallelConfig(cp=2), local_seq_len=1)
            spec_for(c).check_layout(c, request)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("learned", "mtp_num_layers (2) needs position 'rope' or 'none'"),
        ("short", "mtp_num_layers (2) needs sequences longer than 2 tokens"),
        ("cp", "under context parallelism (cp 2) an MTP model needs its labels shifted"),
        ("rows", "labels of shape (2, 1, 4) fit neither [b, s] nor mtp_labels'"),
        ("layout", "got sequences of 2: lengthen them or lower mtp_num_layers"),
    ],
)
def test_bad_mtp_input_is_one_sentence(dist_pool: DistPool, kind: str, expected: str) -> None:
    for message in dist_pool.run(_message, 2 if kind == "cp" else 1, args=(kind,)):
        assert expected in message and "\n" not in message


def _param_counts(changes: dict[str, object]) -> tuple[int, int, int]:
    c = _config({"mtp_num_layers": 2, **changes})
    model = GPTModel(c, solo_groups(), seed=3)
    assert model.mtp is not None
    mats = sum(p.numel() for p in model.mtp.parameters() if p.dim() >= 2)
    norms = sum(p.numel() for p in model.mtp.parameters() if p.dim() < 2)
    return mats, norms, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"num_experts": 4, "moe_top_k": 2},
        {"norm": "layernorm", "activation": "gelu"},
        {"size": "deepseek-v3-tiny"},
    ],
)
def test_mtp_parameter_counts_match_the_built_model(
    dist_pool: DistPool, changes: dict[str, object]
) -> None:
    c = _config({"mtp_num_layers": 2, **changes})
    mats, norms, total = dist_pool.run(_param_counts, 1, args=(changes,))[0]
    assert mtp_matmul_params(c) == mats
    assert mtp_norm_params(c) == norms
    assert spec_for(c).total_params(c) == total


def test_mtp_flops_are_one_more_layer_and_head_per_depth() -> None:
    """A dense depth costs one more decoder layer, ``eh_proj`` and the output layer again."""
    h, v = BASE.hidden_size, BASE.vocab_size
    for depth in (1, 2):
        c = BASE.replace(mtp_num_layers=depth)
        deeper = BASE.replace(num_layers=BASE.num_layers + depth)
        spec = spec_for(c)
        layer = spec.flops_per_token(deeper, SEQ) - spec.flops_per_token(BASE, SEQ)
        assert mtp_flops_per_token(c, SEQ) == layer + 3 * 2 * depth * (2 * h * h + h * v)
        assert spec.flops_per_token(c, SEQ) == spec.flops_per_token(
            BASE, SEQ
        ) + mtp_flops_per_token(c, SEQ)
    assert mtp_flops_per_token(BASE, SEQ) == 0.0


def _check_recompute(recompute: str) -> None:
    c = BASE.replace(mtp_num_layers=2)
    tokens, labels = _data(c.vocab_size)
    plain = GPTModel(c, solo_groups(), seed=3)
    again = GPTModel(c, solo_groups(), seed=3, recompute=recompute)  # type: ignore[arg-type]
    want = _grads(plain, plain(tokens, labels).mean())
    got = _grads(again, again(tokens, labels).mean())
    assert got.keys() == want.keys()
    for name, grad in got.items():  # the same kernels on the same shapes, recomputed
        assert torch.equal(grad, want[name]), name


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recomputed_depths_give_the_same_gradients(dist_pool: DistPool, recompute: str) -> None:
    dist_pool.run(_check_recompute, 1, args=(recompute,))
