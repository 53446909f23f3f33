"""The Triton causal conv + SiLU and gated RMSNorm equal the torch composition the Mamba-2
mixer uses otherwise (outputs and every gradient), alone and inside the mixer, eager and
under ``torch.compile``.

The kernel cases run in one child process (``_child_cases``): in the Triton interpreter on
CPU, the compiled kernels when CUDA is there.

Tolerances: fp64 against the fp64 torch composition at ``assert_close_to_reference``'s
rounding bound (16 · u · sqrt(n) · max |reference|), ``n`` the longest chain of sums behind
one element, the two sides summing in other orders: the conv's ``k`` taps and its bias
(``k + 1``); its input gradient, ``k`` terms of a ``k + 1``-term pre-activation
(``2k + 1``); its weight and bias gradients, every position of every batch row on top
(``s·b + k + 1``); the norm's mean over ``w`` channels (``w + 1``), its backward a second
``w``-sum (``2w + 2``) and, for the weight, every row (``rows + w + 1``). The fp16 and bf16
cases keep the bound at their own ``u`` (fp32 inside; rounding the inputs to the half type
adds about ``u`` relative, inside it).
"""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("triton")

from _child_cases import child_case_results

from mega_models.hybrid_config import HybridConfig
from mega_models.mamba import Mamba2Mixer
from mega_models.mixer_triton import causal_conv1d_silu, gated_rms_norm
from mega_parallel_grid.testing import DistPool, assert_close_to_reference, solo_groups

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F64, BF16 = torch.float64, torch.bfloat16


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _conv_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The mixer's torch path: ``[s, b, ..] -> [b, ch, s]``, left pad, conv1d, SiLU, back."""
    s, b = x.shape[:2]
    seq_last = x.reshape(s, b, -1).permute(1, 2, 0)
    padded = F.pad(seq_last, (weight.shape[1] - 1, 0))
    out = F.conv1d(padded, weight.unsqueeze(1), bias, groups=weight.shape[0])
    return F.silu(out).permute(2, 0, 1).reshape(x.shape)


def _check_conv(
    s: int, b: int, g: int, c: int, k: int, with_bias: bool, mixer_slices: bool,
    dtype: torch.dtype = F64,
) -> None:  # fmt: skip
    """With ``mixer_slices`` x is the mixer's view: per group ``c`` channels at offset 3 of a
    row of ``c + 5`` (in_proj's ``z, xBC, dt``), ``[s, b, g, c]``; else ``[s, b, g * c]``."""
    rows = _randn(s, b, g, c + 5, seed=0)
    weight = _randn(g * c, k, seed=1)
    bias = _randn(g * c, seed=2) if with_bias else None

    def leaves(device: str, dtype: torch.dtype) -> list[torch.Tensor]:
        x = rows.to(device, dtype)[..., 3 : 3 + c]
        x = x if mixer_slices else x.reshape(s, b, g * c).contiguous()
        return [t.to(device, dtype).requires_grad_() for t in (x, weight, bias) if t is not None]

    def conv(ins: list[torch.Tensor], fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        return fn(ins[0], ins[1], ins[2] if with_bias else None)

    ref_in, mine_in = leaves("cpu", F64), leaves(DEVICE, dtype)
    assert mine_in[0].is_contiguous() != mixer_slices  # the layout the kernel reads
    ref, out = conv(ref_in, _conv_reference), conv(mine_in, causal_conv1d_silu)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close_to_reference(out, ref, reduction_length=k + 1, name="conv output")
    dy = _randn(*ref.shape, seed=3)
    ref_grads = torch.autograd.grad(ref, ref_in, dy)
    grads = torch.autograd.grad(out, mine_in, dy.to(DEVICE, dtype))
    assert all(mine.dtype == dtype for mine in grads)
    assert_close_to_reference(grads[0], ref_grads[0], reduction_length=2 * k + 1, name="dx")
    for name, mine, full in zip(("dweight", "dbias"), grads[1:], ref_grads[1:], strict=False):
        assert_close_to_reference(mine, full, reduction_length=s * b + k + 1, name=name)
    again = torch.autograd.grad(conv(mine_in, causal_conv1d_silu), mine_in, dy.to(DEVICE, dtype))
    assert all(torch.equal(a, r) for a, r in zip(again, grads, strict=True)), "not deterministic"


def _norm_reference(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    g, w = y.shape[-2:]
    return F.rms_norm(y * F.silu(z), (w,), eps=eps) * weight.view(g, w)


def _check_norm(lead: tuple[int, ...], g: int, w: int, dtype: torch.dtype) -> None:
    """``z`` a strided slice as the mixer's (``w`` channels of each group's longer row)."""
    y, z_rows = _randn(*lead, g, w, seed=4), _randn(*lead, g, w + 7, seed=5)
    weight = 1.0 + 0.5 * _randn(g * w, seed=6)

    def leaves(device: str, dtype: torch.dtype) -> list[torch.Tensor]:
        z = z_rows.to(device, dtype)[..., 2 : 2 + w]
        return [t.to(device, dtype).requires_grad_() for t in (y, z, weight)]

    ref_in, mine_in = leaves("cpu", F64), leaves(DEVICE, dtype)
    assert not mine_in[1].is_contiguous()
    eps = 1e-5
    ref = _norm_reference(*ref_in, eps)
    out = gated_rms_norm(*mine_in, eps)
    assert out.dtype == dtype and out.shape == ref.shape
    rows = out.numel() // w
    assert_close_to_reference(out, ref, reduction_length=w + 1, name="norm output")
    dout = _randn(*ref.shape, seed=7)
    ref_grads = torch.autograd.grad(ref, ref_in, dout)
    grads = torch.autograd.grad(out, mine_in, dout.to(DEVICE, dtype))
    for name, mine, full in zip(("dy", "dz"), grads[:2], ref_grads[:2], strict=True):
        assert mine.dtype == dtype
        assert_close_to_reference(mine, full, reduction_length=2 * w + 2, name=name)
    assert_close_to_reference(grads[2], ref_grads[2], reduction_length=rows + w + 1, name="dweight")


def _world_of_one() -> None:
    if not dist.is_initialized():  # the child process
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _mixer_triton_equals_torch() -> None:
    """Both with the torch scan: the conv and the norm are all that differ."""
    config = HybridConfig(hidden_size=32, num_attention_heads=4, mamba_head_dim=8,
                          mamba_num_groups=2, mamba_state_dim=6, mamba_chunk_size=5,
                          ssd_kernel="torch")  # fmt: skip
    _world_of_one()
    tp = solo_groups().tp
    outs, grads = [], []
    for kernel in ("torch", "triton"):
        mixer = Mamba2Mixer(config.replace(mixer_kernel=kernel), tp_group=tp, seed=3,
                            dtype=F64, device=DEVICE)  # fmt: skip
        x = _randn(12, 2, 32, seed=8).to(DEVICE).requires_grad_()
        out = mixer(x)
        outs.append(out)
        params = [x, *mixer.parameters()]
        grads.append(torch.autograd.grad(out, params, _randn(*out.shape, seed=9).to(DEVICE)))
    # test_ssd_triton's chain for this mixer: in_proj, conv, scan, norm, out_proj, twice
    chain = 2 * (32 + 4 + 12 * 7 + 2 * 64) + 12
    assert_close_to_reference(outs[1], outs[0], reduction_length=chain, name="mixer output")
    names = ["input", *(name for name, _ in mixer.named_parameters())]
    for name, mine, ref in zip(names, grads[1], grads[0], strict=True):
        assert_close_to_reference(mine, ref, reduction_length=chain, name=f"grad {name}")
    # the whole mixer with the kernels traces as one graph (dynamo alone: the same ops run)
    compiled = torch.compile(mixer, backend="eager", fullgraph=True)(x)
    assert torch.equal(compiled, outs[1])


def _compiled_equals_eager() -> None:
    """One graph (``fullgraph``: no break at either op) whose forward and backward run the
    same kernels as eager: equal to the bit."""

    def block(x: torch.Tensor, cw: torch.Tensor, cb: torch.Tensor, z: torch.Tensor,
              nw: torch.Tensor) -> torch.Tensor:  # fmt: skip
        h = causal_conv1d_silu(x, cw, cb)
        return gated_rms_norm(h * 2.0, z, nw, 1e-5).sum(-1)

    leaves = [_randn(9, 2, 2, 8, seed=10)[..., :6], _randn(12, 4, seed=11), _randn(12, seed=12),
              _randn(9, 2, 2, 6, seed=13), _randn(12, seed=14)]  # fmt: skip
    results = []
    for fn in (block, torch.compile(block, backend="aot_eager", fullgraph=True)):
        ins = [t.detach().to(DEVICE).requires_grad_() for t in leaves]
        out = fn(*ins)
        results.append([out, *torch.autograd.grad(out.sum(), ins)])
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)


def _needs_triton_sentence() -> None:
    _world_of_one()
    with mock.patch("mega_models.mamba.triton_available", return_value=False):
        with pytest.raises(ValueError, match=r"mixer_kernel 'triton' needs the triton package"):
            Mamba2Mixer(HybridConfig(mixer_kernel="triton"), tp_group=solo_groups().tp)


def _tp2_sequence_parallel() -> None:
    """test_mamba's tp contract with the kernels on both sides: tp 2 with sequence parallel
    (each rank's conv channels and norm groups its own) == one process. Two GPUs only: in
    the interpreter two fresh workers cost about a minute on 2 CPU cores."""
    if torch.cuda.device_count() < 2:
        raise _NotHere("tp 2 with the kernels runs on two GPUs (here: too slow interpreted)")
    from test_mamba import _tp_contract

    with DistPool() as pool:
        pool.run(_tp_contract, 2, args=(2, True, {"mixer_kernel": "triton"}))


class _NotHere(Exception):
    """A case that cannot run on this machine (the test is skipped, saying why)."""


#: the cases run in the child
CASES: dict[str, Callable[[], None]] = {
    "conv fp64, the mixer's strided slices, bias, s 37 (3 parts of 16), b 2, k 4": lambda: (
        _check_conv(37, 2, 2, 10, 4, True, True)
    ),
    "conv fp64, [s, b, ch], no bias, k 3": lambda: _check_conv(21, 1, 1, 24, 3, False, False),
    "gated norm fp64, 3 groups of 12, z strided, 26 rows (2 parts)": lambda: _check_norm(
        (13, 2), 3, 12, F64
    ),
    # half precision in and out, fp32 inside: within its bound of the fp64 composition
    "conv bf16, the mixer's slices": lambda: _check_conv(20, 2, 2, 8, 4, True, True, BF16),
    "gated norm fp16": lambda: _check_norm((5, 2), 2, 16, torch.float16),
    "gated norm bf16": lambda: _check_norm((5, 2), 2, 16, BF16),
    "mixer: mixer_kernel triton == torch, fp64; one graph compiled": _mixer_triton_equals_torch,
    "torch.compile fullgraph == eager": _compiled_equals_eager,
    "mixer_kernel triton without triton: one sentence": _needs_triton_sentence,
    "tp 2 + sequence parallel == one process, kernels on both": _tp2_sequence_parallel,
}


@pytest.fixture(scope="module")
def case_results() -> dict[str, str]:
    return child_case_results(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_kernels(case_results: dict[str, str], case: str) -> None:
    if _NotHere.__name__ in case_results[case]:
        pytest.skip(case_results[case].strip().splitlines()[-1])
    assert case_results[case] == "ok", case_results[case]


def test_bad_input_raises_one_sentence() -> None:
    x, w, b = torch.zeros(5, 2, 12), torch.zeros(12, 4), torch.zeros(12)
    cases = [
        (lambda: causal_conv1d_silu(x, w[:10], b), r"weight \(10, 4\) must be \[channels, k\] with the 12"),
        (lambda: causal_conv1d_silu(x, w, b[:3]), r"bias \(3,\) must be \(12,\), one per channel"),
        (lambda: causal_conv1d_silu(x[0], w, b), r"x \(2, 12\) must be \[s, b, ch\] or \[s, b, g, c\]"),
        (lambda: gated_rms_norm(x.view(5, 2, 3, 4), x, b, 1e-5), r"y \(5, 2, 3, 4\) and z \(5, 2, 12\)"),
        (lambda: gated_rms_norm(x.view(5, 2, 3, 4), x.view(5, 2, 3, 4), b[:6], 1e-5),
         r"weight \(6,\) must be \(12,\): g \(3\) x w \(4\)"),
    ]  # fmt: skip
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert "\n" not in str(info.value)


def test_config_names_the_kernel_choices() -> None:
    with pytest.raises(ValueError, match=r"mixer_kernel \('cuda'\) must be 'auto', 'triton' or"):
        HybridConfig(mixer_kernel="cuda")
