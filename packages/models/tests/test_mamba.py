"""Mamba2Mixer: equals a step-by-step reference (fp64) and, split over tp, the unsplit mixer."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mega_models.hybrid_config import HybridConfig
from mega_models.mamba import Mamba2Mixer
from mega_models.ssd import ssd_sequential
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import (
    DistPool,
    assert_close_to_reference,
    rank_device,
    solo_groups,
)
from mega_tp_layers import gather_full, shard_spec, sync_sequence_parallel_grads

SEQ, BATCH = 12, 2


def small(**changes: object) -> HybridConfig:
    base = HybridConfig(hidden_size=32, num_attention_heads=4, mamba_head_dim=8,
                        mamba_num_groups=2, mamba_state_dim=6, mamba_chunk_size=5)  # fmt: skip
    return base.replace(**changes)


def _chain(c: HybridConfig, seq: int) -> int:
    """The mixer's longest chain of sums behind one element (``assert_close_to_reference``):
    in_proj (h), the convolution, the scan (seq steps of state-sized products), the gated
    norm and out_proj (inner width each), forward and back, then the tokens of a weight
    gradient."""
    scan = seq * (c.mamba_state_dim + 1)
    forward = c.hidden_size + c.mamba_conv_width + scan + 2 * c.mamba_inner
    return 2 * forward + seq * BATCH


N = _chain(small(), SEQ)


def reference(mixer: Mamba2Mixer, config: HybridConfig, x: torch.Tensor) -> torch.Tensor:
    """The mixer written out plainly from its full (tp = 1) weights, one time step at a time."""
    c = config
    g, n, k = c.mamba_num_groups, c.mamba_state_dim, c.mamba_conv_width
    heads, p = c.mamba_num_heads, c.mamba_head_dim
    w = heads // g * p  # inner channels per group
    s, b, _ = x.shape
    proj = x @ mixer.in_proj.weight.t()  # [s, b, g * (2w + 2n + heads/g)]
    z, xbc, dt = proj.view(s, b, g, -1).split([w, w + 2 * n, heads // g], dim=-1)
    xbc = xbc.reshape(s, b, -1)
    conv = torch.zeros_like(xbc)
    for t in range(s):  # causal: step t sees steps t-k+1 .. t
        for j in range(k):
            if t - (k - 1) + j >= 0:
                conv[t] += mixer.conv_weight[:, j] * xbc[t - (k - 1) + j]
    assert mixer.conv_bias is not None
    conv = F.silu(conv + mixer.conv_bias).view(s, b, g, -1)
    xs, B, C = conv.split([w, n, n], dim=-1)
    xs = xs.reshape(s, b, heads, p)
    low, high = c.mamba_dt_limit
    step = F.softplus(dt.reshape(s, b, heads) + mixer.dt_bias).clamp(min=low, max=high)
    y = ssd_sequential(xs, step, -torch.exp(mixer.A_log), B, C) + xs * mixer.D[:, None]
    gated = y.reshape(s, b, g, w) * F.silu(z)
    rms = gated.pow(2).mean(-1, keepdim=True).add(c.norm_eps).rsqrt()
    normed = (gated * rms).reshape(s, b, g * w) * mixer.norm_weight
    return normed @ mixer.out_proj.weight.t()


# the steps softplus(dt + dt_bias) of small() at seed 3 lie in ~[0.002, 0.075]: this limit
# cuts both ends (about a third of the 192 steps below, a tenth above)
DT_LIMIT = (0.005, 0.05)


def _fp64_reference(changes: dict[str, object]) -> None:
    config = small(**changes)
    mixer = Mamba2Mixer(config, tp_group=solo_groups().tp, seed=3, dtype=torch.float64)
    x = torch.randn(SEQ, BATCH, config.hidden_size, dtype=torch.float64, requires_grad=True)
    out = mixer(x)
    ref = reference(mixer, config, x)
    # fp64, same operations reordered: the rounding bound at fp64's u
    assert_close_to_reference(out, ref, reduction_length=N, name="fp64 output")
    low, high = config.mamba_dt_limit
    if (low, high) != (0.0, math.inf):  # each bound of the limit does bind here
        for one_sided in ((low, math.inf), (0.0, high)):
            other = reference(mixer, config.replace(mamba_dt_limit=one_sided), x)
            assert not torch.allclose(out, other, rtol=1e-6, atol=0), one_sided
    grad = torch.randn_like(out)
    mine = torch.autograd.grad(out, [x, *mixer.parameters()], grad)
    theirs = torch.autograd.grad(ref, [x, *mixer.parameters()], grad)
    names = ["x", *(name for name, _ in mixer.named_parameters())]
    for name, a, r in zip(names, mine, theirs, strict=True):
        assert_close_to_reference(a, r, reduction_length=N, name=f"fp64 {name} grad")
    # causal: a change at step 7 leaves steps 0..6 alone
    x2 = x.detach().clone()
    x2[7:] += 1.0
    torch.testing.assert_close(mixer(x2)[:7], out[:7].detach(), rtol=0, atol=0)


@pytest.mark.parametrize("changes", [{}, {"mamba_dt_limit": DT_LIMIT}], ids=["plain", "dt-limit"])
def test_mixer_matches_plain_reference_fp64(
    dist_pool: DistPool, changes: dict[str, object]
) -> None:
    dist_pool.run(_fp64_reference, 1, args=(changes,))


def _tp_contract(tp: int, sp: bool, changes: dict[str, object]) -> None:
    config = small(**changes)
    groups = init_process_groups(ParallelConfig(tp=tp))
    dev = rank_device()
    ref = Mamba2Mixer(config, tp_group=solo_groups().tp, seed=5)
    mixer = Mamba2Mixer(config, tp_group=groups.tp, sequence_parallel=sp, seed=5, device=dev)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(SEQ, BATCH, config.hidden_size, generator=gen, requires_grad=True)
    dy = torch.randn(SEQ, BATCH, config.hidden_size, generator=gen)
    out_ref = ref(x)
    out_ref.backward(dy)
    rank = groups.rank("tp")
    local_x = (x.detach().chunk(tp)[rank] if sp else x.detach()).to(dev).requires_grad_()
    out = mixer(local_x)
    out.backward((dy.chunk(tp)[rank] if sp else dy).to(dev))
    sync_sequence_parallel_grads(mixer, groups.tp)  # the row bias's partial grads under SP
    # fp32, tp only reorders the sums of the two projections' GEMMs (and of the input
    # gradient): each tensor within the rounding bound of the mixer's chain of sums
    local_ref = out_ref.detach().chunk(tp)[rank] if sp else out_ref.detach()
    assert x.grad is not None and local_x.grad is not None
    local_grad = x.grad.chunk(tp)[rank] if sp else x.grad
    for what, mine, full in (
        ("output", out.detach(), local_ref),
        ("input grad", local_x.grad, local_grad),
    ):
        assert_close_to_reference(mine, full, reduction_length=N, name=what)
    for (name, p), p_ref in zip(mixer.named_parameters(), ref.parameters(), strict=True):
        spec = shard_spec(p)
        assert spec is not None and p.grad is not None and p_ref.grad is not None, name
        assert spec.full_shape == tuple(p_ref.shape), name
        weight = gather_full(p.detach(), spec, groups.tp).cpu()
        torch.testing.assert_close(weight, p_ref.detach(), rtol=0, atol=0, msg=name)  # same draw
        grad = gather_full(p.grad, spec, groups.tp).cpu()
        assert_close_to_reference(grad, p_ref.grad, reduction_length=N, name=f"{name} grad")


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True)], ids=str)
def test_mixer_tp_matches_single_process(dist_pool: DistPool, tp: int, sp: bool) -> None:
    dist_pool.run(_tp_contract, tp, args=(tp, sp, {}))


def test_mixer_tp4_four_groups_with_bias(dist_pool: DistPool) -> None:
    dist_pool.run(_tp_contract, 4, args=(4, True, {"mamba_num_groups": 4, "add_bias": True}))


def _bad_groups() -> str:
    groups = init_process_groups(ParallelConfig(tp=2))
    try:
        Mamba2Mixer(small(mamba_num_groups=1), tp_group=groups.tp)
    except ValueError as error:
        return str(error)
    finally:
        dist.barrier()
    raise AssertionError("no error")


def test_groups_not_divisible_by_tp(dist_pool: DistPool) -> None:
    for message in dist_pool.run(_bad_groups, 2):
        assert message == (
            "mamba_num_groups (1) is not divisible by tp (2); choose tp dividing 1 or more groups"
        )


def _chunk_edges() -> None:
    # sequences of exactly one chunk, of less than one, and of one chunk plus one step
    for seq, chunk in ((5, 5), (3, 5), (6, 5), (8, 8)):
        config = small(mamba_chunk_size=chunk)
        mixer = Mamba2Mixer(config, tp_group=solo_groups().tp, seed=3, dtype=torch.float64)
        x = torch.randn(seq, BATCH, config.hidden_size, dtype=torch.float64)
        # fp64, same operations reordered: the rounding bound at fp64's u
        assert_close_to_reference(mixer(x), reference(mixer, config, x),
                                  reduction_length=_chain(config, seq), name=f"seq {seq}")  # fmt: skip


def test_mixer_at_chunk_edges(dist_pool: DistPool) -> None:
    dist_pool.run(_chunk_edges, 1)
