"""The plain-PyTorch peer: what one GPU does with stock PyTorch at mega's benchmark shape.

    python3 bench/peers/torch_ref.py --mb 8 [--compile] [--precision amp|bf16]
    python3 bench/peers/torch_ref.py --smoke            # CPU, tiny shape: checks that it runs
    python3 bench/peers/torch_ref.py --mb 8 --liger [--compile]  # + Liger Kernel, CUDA only

A Llama-style decoder written the way a user would write it (RMSNorm, RoPE, causal SDPA,
SwiGLU, untied head, mean cross-entropy), fused AdamW (lr 3e-4, weight decay 0.1),
gradient clipping at 1.0, random tokens. ``--compile`` compiles each block and the head +
loss. Precision ``amp``: fp32 parameters under bf16 autocast; ``bf16``: bf16 parameters
with fp32 master weights and fused AdamW on the masters (Megatron's and mega's scheme).
``--liger``: the same model with Liger Kernel's Triton RMSNorm, RoPE, SiLU-mul and fused
linear cross-entropy (no logits materialised), system ``torch-liger`` (bench/peers/_liger.py).
5 warm-up steps, then 20 timed with CUDA events; the median goes to $OUT/results.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from types import ModuleType

import torch
import torch.nn.functional as F
from _common import SHAPE, SMOKE, Shape, record, time_steps
from torch import Tensor, nn


def _norm(h: int, liger: ModuleType | None) -> nn.Module:
    return nn.RMSNorm(h, eps=1e-5) if liger is None else liger.rms_norm(h, eps=1e-5)


class Block(nn.Module):
    def __init__(self, s: Shape, liger: ModuleType | None = None) -> None:
        super().__init__()
        h = s.hidden
        self.heads, self.liger = s.heads, liger
        self.norm1, self.norm2 = _norm(h, liger), _norm(h, liger)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * s.ffn, bias=False)
        self.down = nn.Linear(s.ffn, h, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x [b, s, h]
        b, n, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, h // self.heads).unbind(2)
        if self.liger is None:
            q, k = (_rope(t, cos, sin).transpose(1, 2) for t in (q, k))  # [b, heads, s, d]
        else:
            q, k = self.liger.rope(q, k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, h))
        if self.liger is not None:
            return x + self.down(self.liger.swiglu(self.norm2(x), self.gate_up.weight))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def _rope(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate halves of the head dim: ``t [b, s, heads, d]``, ``cos``/``sin`` ``[s, 1, d/2]``."""
    a, b = t.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(t.dtype)


class Head(nn.Module):
    def __init__(self, s: Shape, liger: ModuleType | None = None) -> None:
        super().__init__()
        self.liger = liger
        self.norm = _norm(s.hidden, liger)
        self.out = nn.Linear(s.hidden, s.vocab, bias=False)

    def forward(self, x: Tensor, targets: Tensor) -> Tensor:
        if self.liger is not None:
            loss: Tensor = self.liger.linear_cross_entropy(self.out.weight, self.norm(x), targets)
            return loss
        logits = self.out(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class Model(nn.Module):
    def __init__(self, s: Shape, liger: ModuleType | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.blocks = nn.ModuleList(Block(s, liger) for _ in range(s.layers))
        self.head = Head(s, liger)
        d = s.hidden // s.heads
        freqs = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        angles = torch.outer(torch.arange(s.seq).float(), freqs)[:, None, :]  # [s, 1, d/2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = (
                    0.02 / math.sqrt(2 * s.layers)
                    if name.endswith(("proj.weight", "down.weight"))
                    else 0.02
                )
                nn.init.normal_(p, std=std)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(x, targets)  # type: ignore[no-any-return]


def _masters(model: nn.Module) -> list[Tensor]:
    return [p.detach().float().requires_grad_(True) for p in model.parameters()]


def _load_liger() -> ModuleType:
    try:
        import _liger
    except ModuleNotFoundError as e:
        if e.name != "liger_kernel":
            raise
        raise SystemExit(
            "--liger needs the liger-kernel package; install it (the GPU machine: "
            "pip install --no-index --target /tmp/site .whl/liger_kernel-*.whl)"
        ) from e
    return _liger


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=8)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--precision", choices=("amp", "bf16"), default="amp")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, 2 steps")
    ap.add_argument("--liger", action="store_true", help="Liger Kernel's Triton kernels (CUDA)")
    args = ap.parse_args()
    shape, cuda = (SMOKE if args.smoke else SHAPE), torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.steps, args.warmup = 2, 1
    device = torch.device("cuda" if cuda else "cpu")
    liger = _load_liger() if args.liger else None
    torch.manual_seed(0)
    model = Model(shape, liger).to(device)
    bf16 = args.precision == "bf16"
    masters: list[Tensor] = []
    if bf16:
        model = model.to(torch.bfloat16)
        masters = _masters(model)
    params = masters or list(model.parameters())
    decay = [p for p in params if p.dim() == 2]
    other = [p for p in params if p.dim() != 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=3e-4, betas=(0.9, 0.95), fused=cuda,
    )  # fmt: skip
    if args.compile:
        for block in model.blocks:
            block.compile()
        model.head.compile()
    tokens = torch.randint(0, shape.vocab, (args.mb, shape.seq + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model_params = list(model.parameters())

    def autocast() -> contextlib.AbstractContextManager[None]:
        if args.precision == "amp" and cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step() -> Tensor:
        with autocast():
            loss = model(inputs, targets)
        loss.backward()
        if bf16:
            for m, p in zip(masters, model_params, strict=True):
                m.grad = p.grad.float() if p.grad is not None else None
                p.grad = None
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if bf16:
            with torch.no_grad():
                torch._foreach_copy_(model_params, masters)
        return loss.detach()

    times, loss = time_steps(step, args.warmup, args.steps)
    system = "torch-liger" if args.liger else "torch"
    result = {"system": system, "compile": args.compile, "precision": args.precision,
              "mb": args.mb, "loss": float(loss)}  # fmt: skip
    record(result, times, args.mb * shape.seq, shape)


if __name__ == "__main__":
    main()
