"""HybridModel at tp x pp (with and without sequence parallel) equals the unsplit model:
losses, gradients, and weights after three AdamW steps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _tolerance import model_reduction_length
from torch import nn

from mega_models import GPTConfig, finalize_model_grads, model_config
from mega_models.hybrid import HybridModel
from mega_models.hybrid_config import HybridConfig
from mega_models.stages import stage_spec
from mega_parallel_grid import ParallelConfig, ProcessGroups, init_process_groups
from mega_parallel_grid.testing import (
    DistPool,
    assert_close_to_reference,
    rank_device,
    solo_groups,
)
from mega_tp_layers import gather_full, shard_spec

# fp32 on CPU. A layout only reorders float sums (tp splits GEMM reductions; SP
# all-reduces norm gradients; pp does not change arithmetic), so each tensor is compared
# through ``assert_close_to_reference`` with n the model's chain of sums over all three
# steps (N below), as in the GPT contract test. AdamW is elementwise, so the weights after
# three steps keep that agreement (m / sqrt(v) is insensitive to the rounding of g).
SEQ, BATCH, STEPS = 16, 2, 3


def config(**changes: object) -> HybridConfig:
    """4 layers (2 per stage at pp 2); chunk 5 does not divide the sequence (padding)."""
    base = HybridConfig(
        vocab_size=97, hidden_size=32, pattern="M*-M", num_layers=4, num_attention_heads=4,
        num_query_groups=2, ffn_hidden_size=64, max_seq_len=64, mamba_state_dim=8,
        mamba_head_dim=8, mamba_num_groups=2, mamba_chunk_size=5,
    )  # fmt: skip
    return base.replace(**changes)


N = model_reduction_length(config(), seq=SEQ, tokens=SEQ * BATCH, steps=STEPS)


def batch(c: HybridConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, c.vocab_size, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def full_tensors(model: nn.Module, vocab: int, grads: bool) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) gathered over tp, vocabulary padding cut, on the CPU."""
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p.detach()
        assert t is not None, f"{name} has no gradient"
        spec = shard_spec(p)
        if spec is not None and spec.dim is not None and spec.num_shards > 1:
            t = gather_full(t.detach(), spec, model.tp_group)  # type: ignore[arg-type]
        if name in ("embedding.word.weight", "output.weight"):
            t = t[:vocab]
        out[name] = t.detach().cpu().clone()
    return out


def compare(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str) -> None:
    assert mine and set(mine) <= set(ref), f"{what}: unknown names {set(mine) - set(ref)}"
    for name, value in mine.items():
        assert_close_to_reference(value, ref[name], reduction_length=N, name=f"{what} {name}")


def run_stages(model: HybridModel, groups: ProcessGroups, ids: torch.Tensor,
               labels: torch.Tensor) -> torch.Tensor | None:  # fmt: skip
    """Forward and backward of the mean loss through the pipeline, by hand (send/recv)."""
    pp, me, dev = groups.size("pp"), groups.rank("pp"), rank_device()
    ranks = dist.get_process_group_ranks(groups.pp)
    x: torch.Tensor = ids.to(dev)
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
    assert pp == 1 or model.stage.first != model.stage.last
    return out.detach().cpu() if model.stage.last else None


def _optimizer(name: str, params: object) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)  # type: ignore[arg-type]
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)  # type: ignore[arg-type]


def _contract(tp: int, pp: int, sp: bool, changes: dict[str, object], optim: str = "adamw") -> None:
    c = config(**changes)
    groups = init_process_groups(ParallelConfig(tp=tp, pp=pp))
    stage = stage_spec(c.num_layers, pp, groups.rank("pp"))
    ref = HybridModel(c, solo_groups(), seed=11)
    model = HybridModel(c, groups, stage=stage, sequence_parallel=sp, seed=11, device=rank_device())
    assert [layer.kind for layer in model.layers.values()] == [c.pattern[i] for i in stage.layers]  # type: ignore[union-attr]
    compare(
        full_tensors(model, c.vocab_size, False), full_tensors(ref, c.vocab_size, False), "init"
    )
    opt_ref, opt = _optimizer(optim, ref.parameters()), _optimizer(optim, model.parameters())
    for step in range(STEPS):
        ids, labels = batch(c, step)
        ref_loss = ref(ids, labels)
        ref_loss.mean().backward()
        loss = run_stages(model, groups, ids, labels)
        finalize_model_grads(model, groups)
        if loss is not None:
            assert_close_to_reference(loss, ref_loss, reduction_length=N, name=f"step {step} loss")
        compare(full_tensors(model, c.vocab_size, True), full_tensors(ref, c.vocab_size, True),
                f"step {step} grad")  # fmt: skip
        for optimizer in (opt_ref, opt):
            optimizer.step()
            optimizer.zero_grad()
    compare(full_tensors(model, c.vocab_size, False), full_tensors(ref, c.vocab_size, False),
            f"weights after {STEPS} {optim} steps")  # fmt: skip


LAYOUTS = [(1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False), (2, 2, True)]


@pytest.mark.parametrize(("tp", "pp", "sp"), LAYOUTS, ids=str)
def test_hybrid_layouts_match_single_process(
    dist_pool: DistPool, tp: int, pp: int, sp: bool
) -> None:
    dist_pool.run(_contract, tp * pp, args=(tp, pp, sp, {}))


def test_hybrid_variant_tied_learned_layernorm(dist_pool: DistPool) -> None:
    """Tied embeddings across pp stages, learned positions, LayerNorm, GeLU, biases.

    With SGD: the key bias's true gradient is exactly zero (softmax ignores a shift shared
    by a row), so its computed gradient is pure rounding noise, which Adam's g / sqrt(v)
    would blow up to updates of O(lr) that differ between layouts.
    """
    changes = {"tie_embeddings": True, "position": "learned", "norm": "layernorm",
               "activation": "gelu", "add_bias": True, "pattern": "-MM*"}  # fmt: skip
    dist_pool.run(_contract, 4, args=(2, 2, True, changes, "sgd"))


def _recompute() -> None:
    c = config()
    plain = HybridModel(c, solo_groups(), seed=3)
    ids, labels = batch(c, 0)
    plain(ids, labels).sum().backward()
    for mode in ("selective", "full"):
        again = HybridModel(c, solo_groups(), seed=3, recompute=mode)  # type: ignore[arg-type]
        again(ids, labels).sum().backward()
        for (name, a), b in zip(plain.named_parameters(), again.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=f"{mode} {name}")


def test_recompute_gives_identical_gradients(dist_pool: DistPool) -> None:
    dist_pool.run(_recompute, 1)


# --- bad input: one sentence each --------------------------------------------------------


def _raises(error: type[Exception], build: object) -> str:
    with pytest.raises(error) as info:
        build()  # type: ignore[operator]
    message = str(info.value)
    assert "\n" not in message
    return message


def test_config_errors() -> None:
    assert _raises(ValueError, lambda: config(pattern="M*X-")) == (
        "pattern 'M*X-' has unknown layer letters 'X'; use 'M' Mamba-2 mixer, "
        "'*' self-attention, '-' MLP, 'E' mixture of experts"
    )
    assert _raises(ValueError, lambda: config(pattern="M*E-")) == (  # more in test_hybrid_moe
        "pattern 'M*E-' has an MoE layer at position 2 but num_experts is 0; set num_experts "
        "(and moe_top_k) or use '-' for a dense MLP"
    )
    assert _raises(ValueError, lambda: config(pattern="M*M-", num_layers=6)) == (
        "pattern 'M*M-' has 4 layers but num_layers is 6; make them equal"
    )
    assert _raises(ValueError, lambda: HybridConfig(pattern="")) == (
        "pattern ('') must be a non-empty string such as 'M*M-'"
    )
    assert _raises(ValueError, lambda: config(mamba_head_dim=12)) == (
        "the Mamba inner width (2 * 32 = 64) is not divisible by mamba_head_dim (12); "
        "change mamba_head_dim or mamba_expand"
    )
    assert _raises(ValueError, lambda: config(mamba_num_groups=3)) == (
        "Mamba heads (8) are not divisible by mamba_num_groups (3); choose a group count "
        "dividing the head count"
    )
    assert _raises(ValueError, lambda: config(mamba_chunk_size=0)) == (
        "mamba_chunk_size (0) must be a positive integer"
    )
    assert _raises(ValueError, lambda: config(mamba_dt_limit=(0.1, 0.1))) == (
        "mamba_dt_limit (0.1, 0.1) must satisfy 0 <= low < high"
    )
    assert _raises(ValueError, lambda: config(nonsense=1)).startswith(
        "HybridConfig has no field nonsense; known fields: "
    )
    assert _raises(ValueError, lambda: config(mtp_num_layers=1)) == (
        "mtp_num_layers (1) is not supported by hybrid models (multi-token prediction is "
        "built for the GPT family); set it to 0"
    )
    mla = {"attention": "mla", "kv_lora_rank": 16, "qk_nope_head_dim": 8,
           "qk_rope_head_dim": 4, "v_head_dim": 8}  # fmt: skip
    assert _raises(ValueError, lambda: config(**mla)) == (
        "attention ('mla') is not supported by hybrid models, whose attention layers are "
        "standard (GQA) self-attention; set attention to 'mha'"
    )
    assert config(pattern="M*M-M*").num_layers == 6  # replace(pattern=...) follows the pattern


def _model_errors() -> list[str]:
    tp2 = init_process_groups(ParallelConfig(tp=2))
    cp2 = init_process_groups(ParallelConfig(cp=2))
    solo = solo_groups()
    return [
        _raises(ValueError, lambda: HybridModel(config(mamba_num_groups=1), tp2)),
        _raises(ValueError, lambda: HybridModel(config(num_query_groups=1), tp2)),
        _raises(ValueError, lambda: HybridModel(config(), cp2)),
        _raises(ValueError, lambda: HybridModel(config(), solo, sequence_parallel=True)),
        _raises(TypeError, lambda: HybridModel(GPTConfig(), solo)),  # type: ignore[arg-type]
        # only the letters present are checked: no attention, so 1 KV head is fine at tp 2
        str(HybridModel(config(num_query_groups=1, pattern="M-M-"), tp2).config.pattern),
    ]


def test_model_errors(dist_pool: DistPool) -> None:
    for messages in dist_pool.run(_model_errors, 2):
        assert messages == [
            "mamba_num_groups (1) is not divisible by tp (2); choose tp dividing 1",
            "num_query_groups (1) is not divisible by tp (2); choose tp dividing 1",
            "HybridModel does not support context parallelism (cp = 2): a Mamba scan needs "
            "the whole sequence; use cp = 1",
            "sequence_parallel=True needs tp > 1; turn it off or raise tp",
            "HybridModel needs a HybridConfig, got GPTConfig; build one with "
            "HybridConfig(pattern=..., ...) or hybrid_config(name)",
            "M-M-",
        ]


def test_attention_and_mlp_flops_equal_gpt() -> None:
    """A '*-' pattern is one GPT layer: the two FLOP counts agree."""
    from mega_models import model_flops_per_token
    from mega_models.hybrid_flops import hybrid_flops_per_token

    gpt = model_config("tiny").replace(num_layers=1)
    hybrid = HybridConfig(**{**vars(gpt), "num_layers": 2, "pattern": "*-"})
    assert hybrid_flops_per_token(hybrid, 128) == model_flops_per_token(gpt, 128)


def _counted_flops() -> tuple[float, float]:
    from torch.utils.flop_counter import FlopCounterMode

    from mega_models.hybrid_flops import hybrid_flops_per_token

    # no attention: the flop counter of some torch versions skips the CPU SDPA kernel (the
    # attention term is checked against GPT's count above); no vocabulary padding; chunks
    # of 4 divide the sequence
    c = config(vocab_size=96, mamba_chunk_size=4, pattern="M-M-")
    model = HybridModel(c, solo_groups(), seed=1)
    ids, _ = batch(c, 0)
    with FlopCounterMode(display=False) as counter:
        model(ids)
    return counter.get_total_flops(), hybrid_flops_per_token(c, SEQ) / 3 * SEQ * BATCH


def test_flop_formula_matches_counted_forward(dist_pool: DistPool) -> None:
    """Every matmul, conv and SSD FLOP the forward issues, and no other."""
    [(counted, formula)] = dist_pool.run(_counted_flops, 1)
    assert counted == formula
