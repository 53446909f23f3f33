"""Split backward (B now, W from the store later) of mega-models' layers == their fused backward.

Each case runs one module's backward fused and split (``_wgrad_testing.fused_and_split``)
from the same weights, inputs and output gradient, in fp32 on the CPU: the norms (W: the
weight and bias gradients, ``sum(dy * x_hat)`` and ``sum(dy)``; B: the input gradient in
closed form), a whole transformer layer under context parallelism (cp 2: attention has
no weights, its linears and norms are split; the layer's outputs and gradients equal the
fused ones), and the Mamba-2 mixer, which splits through its column/row linears only:
its conv1d, ``A_log``, ``D``, ``dt_bias`` and gated-norm weight keep their gradient in B;
and whole tiny GPT and hybrid models at tp 1 and tp 2 + SP (embedding, head, everything).
The forward is the same either way (bitwise); RMSNorm's backward on the CPU is written out
rather than autograd through the composite, so gradients agree to the rounding bound of
``assert_close_to_reference`` with n the chain of sums behind one element.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _tolerance import model_reduction_length
from _wgrad_testing import SplitRun, fused_and_split
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mega_models import model_config
from mega_models.context_parallel import zigzag_split
from mega_models.hybrid_config import HybridConfig
from mega_models.layer import TransformerLayer
from mega_models.mamba import Mamba2Mixer
from mega_models.norms import Norm
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import DistPool, assert_close_to_reference
from mega_tp_layers import defer_weight_grads, shard_tensor

S, B, H = 8, 2, 32


def _assert_close(run: SplitRun, n: int, what: str) -> None:
    assert torch.equal(run.split_out, run.fused_out), f"{what}: the forward changed"
    for name, fused in run.fused.items():
        assert_close_to_reference(
            run.split[name], fused, reduction_length=n, name=f"{what}: {name}"
        )


def _check_norm(kind: str, dtype: torch.dtype, device: str = "cpu") -> None:
    g = init_process_groups(ParallelConfig()).tp
    norm = Norm(H, kind, 1e-5, tp_group=g, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x0 = (3.0 * torch.randn(S, B, H, generator=gen) + 1.0).to(device, dtype)
    dy = torch.randn(S, B, H, generator=gen).to(device, dtype)

    def forward() -> tuple[Tensor, dict[str, Tensor]]:
        x = x0.clone().requires_grad_()
        return norm(x), {"x": x}

    run = fused_and_split(norm, forward, dy)
    assert run.early == set() and run.deferred == 1, (run.early, run.deferred)
    assert all(g.dtype == dtype for g in run.split.values())
    # n: the normalisation's sums over h, forward and back, then a weight's sum over tokens
    _assert_close(run, 4 * H + S * B, f"{kind} {dtype}")


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_norm_split_equals_fused(dist_pool: DistPool, kind: str) -> None:
    dist_pool.run(_check_norm, 1, (kind, torch.float32))


def test_norm_split_in_bf16(dist_pool: DistPool) -> None:
    """bf16 parameters get bf16 gradients (the sums run in fp32), to bf16's rounding bound."""
    dist_pool.run(_check_norm, 1, ("layernorm", torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="aten's fused RMSNorm backward is CUDA's")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_norm_split_on_cuda(dist_pool: DistPool, kind: str, dtype: torch.dtype) -> None:
    """On a GPU both halves run aten's fused kernels (``_fused_rms_norm_backward`` masked)."""
    dist_pool.run(_check_norm, 1, (kind, dtype, "cuda"))


class _CountOps(TorchDispatchMode):
    """The aten ops that make a tensor, views and ``detach`` left out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        made = any(isinstance(t, Tensor) for t in tree_leaves(out))
        if made and not func.is_view and func is not torch.ops.aten.detach.default:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return out


def _norm_backward_ops(kind: str, dtype: torch.dtype) -> tuple[Counter[str], Counter[str]]:
    """Ops of the fused backward with the weights frozen (its input path alone), and of B."""
    g = init_process_groups(ParallelConfig()).tp
    norm = Norm(H, kind, 1e-5, tp_group=g, dtype=dtype)
    x0, dy = torch.randn(S, B, H).to(dtype), torch.randn(S, B, H).to(dtype)
    for p in norm.parameters():
        p.requires_grad_(False)
    y = norm(x0.clone().requires_grad_())
    with _CountOps() as fused:
        y.backward(dy)
    for p in norm.parameters():
        p.requires_grad_(True)
    with defer_weight_grads() as store:
        y = norm(x0.clone().requires_grad_())
    with _CountOps() as split_b:
        y.backward(dy)
    assert len(store) == 1
    return fused.ops, split_b.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_norm_b_runs_no_more_ops_than_the_fused_input_path(
    dist_pool: DistPool, kind: str, dtype: torch.dtype
) -> None:
    """B gives the input gradient with at most the ops of the fused backward's input path,
    plus 0: LayerNorm's B is the fused ``native_layer_norm_backward`` with the weight
    outputs masked off (1 op either way); RMSNorm's is ``_fused_rms_norm_backward`` where
    aten has it (CUDA) and elsewhere 7 ops in fp32 from the forward's ``rstd`` (+4 casts
    in bf16), against 12 (14) of autograd through ``F.rms_norm``'s CPU composite. The
    closed form of before recomputed the statistics and failed 3 of the 4 cases: B ran 15
    (19) ops for LayerNorm's 1, and 15 for RMSNorm's 14 in bf16 (11 of 12 in fp32)."""
    [(fused, split_b)] = dist_pool.run(_norm_backward_ops, 1, (kind, dtype))
    assert sum(split_b.values()) <= sum(fused.values()), (dict(split_b), dict(fused))


def _check_cp_layer(cp: int) -> None:
    groups = init_process_groups(ParallelConfig(cp=cp))
    rank = dist.get_rank(groups.cp)
    c = model_config("tiny").replace(hidden_size=H, num_attention_heads=4, ffn_hidden_size=64)
    torch.manual_seed(0)  # the same weights on every rank
    layer = TransformerLayer(c, tp_group=groups.tp, cp_group=groups.cp, sequence_parallel=False)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.5)
    gen = torch.Generator().manual_seed(5)
    x_full, dy_full = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
    x0, dy = zigzag_split(x_full, cp, rank, dim=0), zigzag_split(dy_full, cp, rank, dim=0)

    def forward() -> tuple[Tensor, dict[str, Tensor]]:
        x = x0.clone().requires_grad_()
        return layer(x, None, S), {"x": x}

    run = fused_and_split(layer, forward, dy)
    assert run.early == set(), f"every weight of the layer waits for W, got {run.early}"
    assert run.deferred == 6, "qkv, proj, fc1, fc2 and the two norms"
    _assert_close(run, model_reduction_length(c, seq=S, tokens=S * B), f"cp {cp} layer")


@pytest.mark.parametrize("cp", [1, 2])
def test_context_parallel_layer_split_equals_fused(dist_pool: DistPool, cp: int) -> None:
    dist_pool.run(_check_cp_layer, cp, (cp,))


MAMBA_FUSED = {"conv_weight", "conv_bias", "dt_bias", "A_log", "D", "norm_weight"}


def _check_mamba(tp: int, sp: bool) -> None:
    g = init_process_groups(ParallelConfig(tp=tp)).tp
    rank = dist.get_rank(g)
    c = HybridConfig(hidden_size=H, num_attention_heads=4, mamba_head_dim=8,
                     mamba_num_groups=2, mamba_state_dim=6, mamba_chunk_size=5)  # fmt: skip
    mixer: nn.Module = Mamba2Mixer(c, tp_group=g, sequence_parallel=sp, seed=3)
    gen = torch.Generator().manual_seed(6)
    x_full, dy_full = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
    x0 = shard_tensor(x_full, 0, rank, tp) if sp else x_full
    dy = shard_tensor(dy_full, 0, rank, tp) if sp else dy_full

    def forward() -> tuple[Tensor, dict[str, Tensor]]:
        x = x0.clone().requires_grad_()
        return mixer(x), {"x": x}

    run = fused_and_split(mixer, forward, dy)
    assert run.early == MAMBA_FUSED, run.early
    assert run.deferred == 2, "in_proj and out_proj"
    for name, fused in run.fused.items():  # the same GEMMs in the same order: equal
        assert torch.equal(run.split[name], fused), f"mamba tp {tp} sp {sp}: {name}"


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, True)], ids=str)
def test_mamba_mixer_splits_its_linears(dist_pool: DistPool, tp: int, sp: bool) -> None:
    dist_pool.run(_check_mamba, tp, (tp, sp))


def _check_model(family: str, tp: int) -> None:
    """A whole model: every weight but the Mamba mixers' own waits for W; loss and
    gradients equal the fused backward's."""
    from mega_models import GPTModel, HybridModel, hybrid_config

    groups = init_process_groups(ParallelConfig(tp=tp))
    sp = tp > 1
    model: nn.Module
    if family == "gpt":
        c = model_config("tiny")
        model = GPTModel(c, groups, sequence_parallel=sp, seed=3)
    else:
        c = hybrid_config("hybrid-tiny")
        model = HybridModel(c, groups, sequence_parallel=sp, seed=3)
    gen = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, c.vocab_size, (B, S + 1), generator=gen)

    def forward() -> tuple[Tensor, dict[str, Tensor]]:
        return model(tokens[:, :-1], tokens[:, 1:]).mean(), {}

    run = fused_and_split(model, forward, torch.ones(()))
    mixer_own = {n for n in run.fused if n.split(".")[-1] in MAMBA_FUSED}
    assert run.early == mixer_own, run.early ^ mixer_own
    assert (family == "hybrid") == bool(mixer_own)
    _assert_close(run, model_reduction_length(c, seq=S, tokens=S * B), f"{family} tp {tp}")


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["gpt", "hybrid"])
def test_whole_model_split_equals_fused(dist_pool: DistPool, family: str, tp: int) -> None:
    dist_pool.run(_check_model, tp, (family, tp))
