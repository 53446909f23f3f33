"""What the split backward runs, op by op: aten ops and bytes of fused B+W against B, then W.

    python3 bench/split_ops.py                 # CPU, fp32, one process
    python3 bench/split_ops.py --dtype bf16    # on a GPU when one is visible
    python3 bench/split_ops.py --cases rmsnorm --compile aot_eager  # + dynamo graph breaks

Device-independent companion of ``bench/split_backward.py`` (issue 23): for one layer kind
at a time (column linear with bias, row linear, RMSNorm, LayerNorm, embedding, MoE grouped
experts) and for a tiny GPT layer stack, it runs the backward fused and split
(``mega_tp_layers.defer_weight_grads``: B in ``backward()``, W in ``store.run()``) from the
same output gradient under a ``TorchDispatchMode`` that counts the aten ops that do work
(views, ``detach`` and other aliases left out) and the bytes of the tensors each reads and
writes. A B whose ops or bytes exceed ``fused - W`` does work the fused backward does not.
``fused input`` is the fused backward with the weights frozen (its input-gradient path
alone), what the norms' B is held to. ``--compile BACKEND`` also counts dynamo's graph
breaks and graphs for the layer stack compiled layer by layer, fused and split. Prints a
table; ``--json`` appends one line per row to ``$OUT/results.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mega_tp_layers import defer_weight_grads


@dataclass
class OpTally:
    """Ops that did work, and the bytes of the tensors they read and wrote."""

    ops: Counter[str] = field(default_factory=Counter)
    bytes: int = 0

    @property
    def count(self) -> int:
        return sum(self.ops.values())


class CountOps(TorchDispatchMode):
    """Tallies every aten op below autograd but views, aliases and ops without a tensor out."""

    def __init__(self) -> None:
        super().__init__()
        self.tally = OpTally()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (
            func.is_view
            or func in _ALIASES
            or not any(isinstance(t, Tensor) for t in tree_leaves(out))
        ):
            return out
        name = str(func.overloadpacket.__name__)
        self.tally.ops[name] += 1
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, Tensor)]
        self.tally.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


_ALIASES = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten._unsafe_view.default,
}

#: (module, forward from fresh inputs, output gradient)
Built = tuple[nn.Module, Callable[[], Tensor], Tensor]
#: builds one on a device and dtype
Case = Callable[[torch.device, torch.dtype], Built]


def _tally(run: Callable[[], None]) -> OpTally:
    with CountOps() as mode:
        run()
    tally: OpTally = mode.tally
    return tally


def measure(module: nn.Module, forward: Callable[[], Tensor], grad: Tensor) -> dict[str, OpTally]:
    """fused, fused input (weights frozen), B and W of one module's backward."""
    out: dict[str, OpTally] = {}
    module.zero_grad(set_to_none=True)
    y = forward()
    out["fused"] = _tally(lambda: y.backward(grad))
    frozen = [p for p in module.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    y = forward()
    if y.requires_grad:
        out["fused input"] = _tally(lambda: y.backward(grad))
    for p in frozen:
        p.requires_grad_(True)
    module.zero_grad(set_to_none=True)
    with defer_weight_grads() as store:
        y = forward()
    out["B"] = _tally(lambda: y.backward(grad))
    out["W"] = _tally(store.run)
    return out


S, B, H, FFN, VOCAB, EXPERTS = 256, 4, 256, 1024, 1000, 4


def _groups() -> Any:
    from mega_parallel_grid.testing import solo_groups

    return solo_groups()


def _input(device: torch.device, dtype: torch.dtype, *shape: int) -> Callable[[], Tensor]:
    x0 = torch.randn(*shape, device=device, dtype=dtype)
    return lambda: x0.clone().requires_grad_()


def _column(device: torch.device, dtype: torch.dtype) -> Built:
    from mega_tp_layers import ColumnParallelLinear

    m = ColumnParallelLinear(H, FFN, tp_group=_groups().tp, device=device, dtype=dtype, seed=1)
    x = _input(device, dtype, S, B, H)
    return m, lambda: m(x()), torch.randn(S, B, FFN, device=device, dtype=dtype)


def _row(device: torch.device, dtype: torch.dtype) -> Built:
    from mega_tp_layers import RowParallelLinear

    m = RowParallelLinear(FFN, H, tp_group=_groups().tp, device=device, dtype=dtype, seed=1)
    x = _input(device, dtype, S, B, FFN)
    return m, lambda: m(x()), torch.randn(S, B, H, device=device, dtype=dtype)


def _norm(kind: str) -> Case:
    def build(device: torch.device, dtype: torch.dtype) -> Built:
        from mega_models.norms import Norm

        m = Norm(H, kind, 1e-5, tp_group=_groups().tp, device=device, dtype=dtype)
        x = _input(device, dtype, S, B, H)
        return m, lambda: m(x()), torch.randn(S, B, H, device=device, dtype=dtype)

    return build


def _embedding(device: torch.device, dtype: torch.dtype) -> Built:
    from mega_tp_layers import VocabParallelEmbedding

    m = VocabParallelEmbedding(VOCAB, H, tp_group=_groups().tp, device=device, dtype=dtype, seed=1)
    ids = torch.randint(0, VOCAB, (S, B), device=device)
    return m, lambda: m(ids), torch.randn(S, B, H, device=device, dtype=dtype)


class _Grouped(nn.Module):
    """Two grouped GEMMs with an activation between, as ``GroupedMLP`` runs its experts."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight1 = nn.Parameter(0.05 * torch.randn(EXPERTS, FFN, H, **kw))
        self.weight2 = nn.Parameter(0.05 * torch.randn(EXPERTS, H, FFN, **kw))

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        from mega_moe._gemm import (
            expert_activation,
            grouped_linear,
            grouped_mm_available,
            split_grouped_linear,
        )
        from mega_tp_layers import current_weight_grad_store

        fast = grouped_mm_available(x, self.weight1, self.weight2)
        store = current_weight_grad_store()
        if store is None:
            h = expert_activation(grouped_linear(x, self.weight1, counts, fast), False)
            return grouped_linear(h, self.weight2, counts, fast)
        h = split_grouped_linear(x, self.weight1, counts, fast, self.weight1, store)
        h = expert_activation(h, False)
        return split_grouped_linear(h, self.weight2, counts, fast, self.weight2, store)


def _experts(device: torch.device, dtype: torch.dtype) -> Built:
    m = _Grouped(device, dtype)
    tokens = S * B
    counts = [tokens // EXPERTS] * EXPERTS
    x = _input(device, dtype, tokens, H)
    return m, lambda: m(x(), counts), torch.randn(tokens, H, device=device, dtype=dtype)


def _gpt_layers(device: torch.device, dtype: torch.dtype) -> Built:
    from mega_models import model_config
    from mega_models.layer import TransformerLayer

    g = _groups()
    c = model_config("tiny").replace(hidden_size=H, num_attention_heads=4, ffn_hidden_size=FFN)
    stack = nn.ModuleList(
        TransformerLayer(c, tp_group=g.tp, cp_group=g.cp, sequence_parallel=False, layer_index=i,
                         device=device, dtype=dtype)
        for i in range(2)
    )  # fmt: skip
    x = _input(device, dtype, S, B, H)

    def forward() -> Tensor:
        y = x()
        for layer in stack:
            y = layer(y, None, S)
        return y

    return stack, forward, torch.randn(S, B, H, device=device, dtype=dtype)


CASES: dict[str, Case] = {
    "column linear + bias": _column,
    "row linear": _row,
    "rmsnorm": _norm("rmsnorm"),
    "layernorm": _norm("layernorm"),
    "embedding": _embedding,
    "moe grouped experts": _experts,
    "gpt layers x2 (tiny)": _gpt_layers,
}


def graph_breaks(backend: str, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Dynamo's graph breaks and graphs for the tiny layer stack, each layer compiled as
    ``train.compile`` does, fused and then split (two forward + backward each)."""
    from torch._dynamo.utils import counters

    cfg = torch._dynamo.config
    limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, limit, max(getattr(cfg, limit), 64))
    result: dict[str, Any] = {}
    for split in (False, True):
        torch._dynamo.reset()
        counters.clear()
        stack, forward, grad = _gpt_layers(device, dtype)
        for layer in stack:
            layer.compile(backend=backend)
        for _ in range(2):
            if split:
                with defer_weight_grads() as store:
                    y = forward()
                y.backward(grad)
                store.run()
            else:
                forward().backward(grad)
        mode = "split" if split else "fused"
        result[f"{mode}_graph_breaks"] = sum(counters["graph_break"].values())
        result[f"{mode}_graphs"] = counters["stats"]["unique_graphs"]
        result[f"{mode}_break_reasons"] = sorted(
            {r.split("\n")[0] for r in counters["graph_break"]}
        )
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default=None)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    ap.add_argument("--ops", action="store_true", help="print each tally's ops by name")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--compile", default=None, metavar="BACKEND",
        help="also count dynamo graph breaks of the compiled layer stack (aot_eager, inductor)",
    )  # fmt: skip
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[
        args.dtype or ("bf16" if cuda else "fp32")
    ]
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29631")
        dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {device.type}, {dtype}, s {S} b {B} h {H} ffn {FFN}")
    print(f"{'case':24} {'fused':>14} {'fused input':>14} {'B':>14} {'W':>14} {'B+W - fused':>16}")
    print(
        f"{'':24} {'ops / MB':>14} {'ops / MB':>14} {'ops / MB':>14} {'ops / MB':>14} {'ops / MB':>16}"
    )
    rows = []
    for name in args.cases.split(","):
        module, forward, grad = CASES[name](device, dtype)
        t = measure(module, forward, grad)

        def cell(key: str, t: dict[str, OpTally] = t) -> str:
            if key not in t:
                return "-"
            return f"{t[key].count} / {t[key].bytes / 2**20:.1f}"

        extra_ops = t["B"].count + t["W"].count - t["fused"].count
        extra_mb = (t["B"].bytes + t["W"].bytes - t["fused"].bytes) / 2**20
        print(f"{name:24} {cell('fused'):>14} {cell('fused input'):>14} {cell('B'):>14} "
              f"{cell('W'):>14} {f'{extra_ops:+d} / {extra_mb:+.1f}':>16}")  # fmt: skip
        if args.ops:
            for key, tally in t.items():
                print(f"    {key:12} {dict(sorted(tally.ops.items()))}")
        rows.append({
            "bench": "split_ops", "case": name, "device": device.type, "dtype": str(dtype),
            **{f"{k.replace(' ', '_')}_ops": v.count for k, v in t.items()},
            **{f"{k.replace(' ', '_')}_bytes": v.bytes for k, v in t.items()},
            "torch": torch.__version__,
        })  # fmt: skip
    if args.compile:
        breaks = graph_breaks(args.compile, device, dtype)
        for mode in ("fused", "split"):
            print(
                f"compiled ({args.compile}) gpt layers x2, {mode}: "
                f"{breaks[f'{mode}_graph_breaks']} graph breaks, {breaks[f'{mode}_graphs']} "
                f"graphs; {'; '.join(breaks[f'{mode}_break_reasons']) or 'no breaks'}"
            )
        rows.append({"bench": "split_ops", "case": "graph breaks", "backend": args.compile,
                     "torch": torch.__version__, **breaks})  # fmt: skip
    out = os.environ.get("OUT")
    if args.json and out:
        with open(os.path.join(out, "results.jsonl"), "a") as f:
            for row in rows:
                f.write(json.dumps(row, sort_keys=True) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
