"""The Mamba-2 state-space scan: the chunked state-space-duality (SSD) algorithm, and the
plain sequential recurrence it must equal.

For each head (scalar decay ``A < 0``, step ``dt_t > 0``, input ``x_t`` of ``p`` channels,
``B_t``/``C_t`` of ``n`` state channels shared by the heads of a group)::

    H_t = exp(dt_t A) H_{t-1} + dt_t x_t B_t^T          H: [p, n], H_{-1} = 0
    y_t = H_t C_t

Unrolled, ``y_t = sum_{s<=t} exp(a_{s+1} + ... + a_t) (C_t . B_s) dt_s x_s`` with
``a = dt A``: a causal, decay-masked attention. The chunked algorithm cuts the sequence
into chunks of ``Q`` steps and computes (1) inside each chunk that quadratic form, (2) the
state each chunk leaves behind on its own, (3) the states entering each chunk, by a
decay-weighted sum over earlier chunks, and (4) what those entering states add to each
chunk's outputs. Work is ``O(l Q)`` per head instead of ``O(l^2)``, in batched matmuls.

Tensors are sequence-first like the rest of the model: ``x [l, b, h, p]``, ``dt [l, b, h]``,
``A [h]``, ``B``/``C [l, b, g, n]`` with ``h`` a multiple of ``g`` (heads ``j*h/g ..``
``(j+1)*h/g - 1`` read group ``j``). The skip term ``D x`` is not included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ssd_chunked", "ssd_sequential"]


def _check(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> tuple[int, int]:
    length, b, h, _ = x.shape
    g = B.shape[2]
    if (dt.shape != (length, b, h) or A.shape != (h,) or B.shape != C.shape
            or B.shape[:2] != (length, b)):  # fmt: skip
        raise ValueError(
            f"SSD shapes do not fit: x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}, "
            f"B {tuple(B.shape)}, C {tuple(C.shape)}; expected x [l, b, h, p], dt [l, b, h], "
            "A [h], B and C [l, b, g, n]"
        )
    if h % g:
        raise ValueError(f"heads ({h}) are not divisible by groups ({g}); choose g dividing h")
    return g, h // g


def ssd_sequential(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> Tensor:
    """The recurrence step by step (the reference): ``[l, b, h, p]`` outputs, ``D x`` excluded."""
    g, r = _check(x, dt, A, B, C)
    length, b, h, p = x.shape
    n = B.shape[-1]
    state = x.new_zeros(b, g, r, p, n)
    decay = torch.exp(dt * A).view(length, b, g, r)  # [l, b, h] -> [l, b, g, r]
    step = (x * dt[..., None]).view(length, b, g, r, p)
    outputs = []
    for t in range(length):
        update = step[t][..., :, None] * B[t][:, :, None, None, :]  # [b, g, r, p, n]
        state = decay[t][..., None, None] * state + update
        y = (state @ C[t][:, :, None, :, None]).squeeze(-1)  # [b, g, r, p, n] @ [b, g, 1, n, 1]
        outputs.append(y.reshape(b, h, p))
    return torch.stack(outputs)  # [l, b, h, p]


def _segment_sums(a: Tensor) -> Tensor:
    """``out[..., i, j] = a[..., j+1] + ... + a[..., i]`` for ``j <= i``, ``-inf`` above.

    Summed directly (a masked cumulative sum), not as a difference of two prefix sums,
    so decays between far-apart steps lose no precision.
    """
    t = a.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=a.device).tril()
    strict = causal.tril(-1)
    grid = a[..., :, None].expand(*a.shape, t).masked_fill(~strict, 0.0)  # [..., i, j] = a_i
    sums = grid.cumsum(dim=-2)  # sum of a_i' over j < i' <= i
    return sums.masked_fill(~causal, float("-inf"))


def ssd_chunked(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int) -> Tensor:
    """The SSD algorithm in chunks of ``chunk_size`` steps: ``[l, b, h, p]``, ``D x`` excluded.

    A sequence that ``chunk_size`` does not divide is padded at its end with steps of zero
    input and zero ``dt`` (no decay), which cannot reach earlier outputs. Computes in the
    dtype of its inputs (pass fp32 for bf16 models: the decays are exponentials of sums).
    """
    g, r = _check(x, dt, A, B, C)
    if chunk_size < 1:
        raise ValueError(f"chunk_size ({chunk_size}) must be a positive integer")
    length, b, h, p = x.shape
    n = B.shape[-1]
    q = chunk_size
    pad = (-length) % q
    if pad:
        x, dt, B, C = (F.pad(t, [0, 0] * (t.dim() - 1) + [0, pad]) for t in (x, dt, B, C))
    c = (length + pad) // q
    # chunk-major; heads split into (group, head in group); positions second to last
    xs = x.view(c, q, b, g, r, p).permute(0, 2, 3, 4, 1, 5)  # [c, b, g, r, q, p]
    steps = dt.view(c, q, b, g, r).permute(0, 2, 3, 4, 1)  # [c, b, g, r, q]
    Bs = B.view(c, q, b, g, n).permute(0, 2, 3, 1, 4)[:, :, :, None]  # [c, b, g, 1, q, n]
    Cs = C.view(c, q, b, g, n).permute(0, 2, 3, 1, 4)[:, :, :, None]  # [c, b, g, 1, q, n]
    log_decay = steps * A.view(g, r, 1)  # a = dt A: [c, b, g, r, q]
    inputs = xs * steps[..., None]  # dt_j x_j: [c, b, g, r, q, p]

    # (1) inside each chunk: y_i = sum_{j<=i} exp(a_{j+1} + .. + a_i) (C_i . B_j) dt_j x_j
    scores = Cs @ Bs.transpose(-1, -2)  # [c, b, g, 1, q, q]
    decay = torch.exp(_segment_sums(log_decay))  # [c, b, g, r, q, q], zero above the diagonal
    y = (scores * decay) @ inputs  # [c, b, g, r, q, p]

    # (2) the state each chunk leaves on its own: sum_j exp(a_{j+1} + .. + a_end) dt_j x_j B_j^T
    to_end = decay[..., -1, :]  # the last row: [c, b, g, r, q]
    states = (inputs * to_end[..., None]).transpose(-1, -2) @ Bs  # [c, b, g, r, p, n]

    # (3) the state entering chunk k: sum_{m<k} exp(T_{m+1} + .. + T_{k-1}) states_m, with T_m
    # the whole decay of chunk m. Shift by one chunk (a zero state first, T_{k-1} at k) and
    # it is a segment sum again: sum_{j<=k} exp(T'_{j+1} + .. + T'_k) states'_j.
    totals = log_decay.sum(dim=-1).permute(1, 2, 3, 0)  # [b, g, r, c]
    carry = torch.exp(_segment_sums(F.pad(totals[..., :-1], (1, 0))))  # [b, g, r, k, j]
    shifted = F.pad(states[:-1], [0, 0] * 5 + [1, 0])  # [c, b, g, r, p, n], zeros first
    flat = shifted.permute(1, 2, 3, 0, 4, 5).flatten(-2)  # [b, g, r, c, p*n]
    entering = (carry @ flat).view(b, g, r, c, p, n).permute(3, 0, 1, 2, 4, 5)  # [c, b, g, r, p, n]

    # (4) what the entering state adds at step i: exp(a_1 + .. + a_i) H_in C_i
    from_start = torch.exp(log_decay.cumsum(dim=-1))  # [c, b, g, r, q]
    y = y + (Cs @ entering.transpose(-1, -2)) * from_start[..., None]

    y = y.permute(0, 4, 1, 2, 3, 5).reshape(c * q, b, h, p)  # -> [l + pad, b, h, p]
    return y[:length]
