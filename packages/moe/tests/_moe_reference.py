"""The dense single-process reference of an MoE layer: plain loops over tokens and experts.

Nothing here uses mega_moe's routing, permutation or dispatch code: each token's logits
are scored, its experts chosen and its output summed one token at a time, on the full
weights, in fp32. Load-balancing losses are written from their textbook formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mega_moe import MoEConfig, MoELayer, RouterConfig


@dataclass
class FullWeights:
    """Every weight of an MoE layer, whole (leaf tensors that collect gradients)."""

    router: Tensor  # [E, h]
    w1: Tensor  # [E, G, ffn, h]
    w2: Tensor  # [E, h, ffn]
    shared1: Tensor | None = None  # [G, fs, h]
    shared2: Tensor | None = None  # [h, fs]
    gate: Tensor | None = None  # [1, h]
    bias: Tensor | None = None  # [E] expert bias (no gradient)

    def leaves(self) -> list[Tensor]:
        return [
            t
            for t in (self.router, self.w1, self.w2, self.shared1, self.shared2, self.gate)
            if t is not None
        ]


def full_weights(layer: MoELayer) -> FullWeights:
    """The weights of a one-process layer (built without groups), detached, requiring grad."""
    experts = layer.experts
    if hasattr(experts, "local_experts"):
        mods = list(experts.local_experts.values())
        w1 = torch.stack([m.weight1.detach() for m in mods])
        w2 = torch.stack([m.weight2.detach() for m in mods])
    else:
        w1, w2 = experts.weight1.detach(), experts.weight2.detach()
    shared = layer.shared_experts
    out = FullWeights(
        layer.router.weight.detach().float().cpu(), w1.float().cpu(), w2.float().cpu()
    )
    if shared is not None:
        out.shared1 = shared.weight1.detach().float().cpu()
        out.shared2 = shared.weight2.detach().float().cpu()
        if shared.gate_weight is not None:
            out.gate = shared.gate_weight.detach().float().cpu()
    bias = layer.router.expert_bias
    out.bias = None if bias is None else bias.detach().float().cpu()
    for t in out.leaves():
        t.requires_grad_(True)
    return out


def _top(values: list[float], k: int, allowed: list[int]) -> list[int]:
    """Indices of the k largest values among ``allowed`` (ties: lower index first)."""
    return sorted(allowed, key=lambda i: (-values[i], i))[:k]


def route_token(logits: Tensor, rc: RouterConfig, bias: Tensor | None) -> tuple[list[int], Tensor]:
    """One token: its experts and their combine weights ``[k]``."""
    e, k = rc.num_experts, rc.top_k
    b = [0.0] * e if bias is None else bias.tolist()
    if rc.score_function == "softmax":
        probs = torch.softmax(logits, dim=0)
        base = probs if rc.softmax_before_topk else logits
    else:
        probs = torch.sigmoid(logits)
        base = probs
    sel = [float(base[i].detach()) + b[i] for i in range(e)]
    allowed = list(range(e))
    if rc.num_groups is not None and rc.group_topk is not None:
        size = e // rc.num_groups
        groups = [list(range(g * size, (g + 1) * size)) for g in range(rc.num_groups)]
        per = k // rc.group_topk
        scores = [sum(sorted((sel[i] for i in grp), reverse=True)[:per]) for grp in groups]
        best = sorted(range(rc.num_groups), key=lambda g: (-scores[g], g))[: rc.group_topk]
        allowed = [i for g in sorted(best) for i in groups[g]]
    chosen = _top(sel, k, allowed)
    idx = torch.tensor(chosen)
    if rc.score_function == "softmax" and not rc.softmax_before_topk:
        weights = torch.softmax(logits[idx], dim=0)
    else:
        weights = probs[idx]
        if rc.normalize_topk:
            weights = weights / (weights.sum() + 1e-20)
    return chosen, weights * rc.scaling_factor


def balance_scores(logits: Tensor, rc: RouterConfig) -> Tensor:
    """The per-token distribution over experts the balancing losses average."""
    if rc.score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    s = torch.sigmoid(logits)
    return s / (s.sum(dim=-1, keepdim=True) + 1e-20)


def expert_mlp(x: Tensor, w1: Tensor, w2: Tensor, gated: bool) -> Tensor:
    """One expert on one token ``[h]``."""
    h = w1.reshape(-1, w1.shape[-1]) @ x
    if gated:
        f = w1.shape[1]
        a = F.silu(h[:f]) * h[f:]
    else:
        a = F.gelu(h, approximate="tanh")
    return w2 @ a


def drop_rule(
    choices: list[list[tuple[int, float]]], e: int, capacity: int, policy: str
) -> set[tuple[int, int]]:
    """The (token, expert) pairs kept: per expert, the ``capacity`` best weights or first."""
    kept: set[tuple[int, int]] = set()
    for ex in range(e):
        pairs = [(t, w) for t, row in enumerate(choices) for (x, w) in row if x == ex]
        if policy == "probs":
            pairs.sort(key=lambda p: (-p[1], p[0]))
        kept.update((t, ex) for t, _ in pairs[:capacity])
    return kept


@dataclass
class Reference:
    outputs: list[Tensor]  # one [s, b, h] per chunk
    kept: list[set[tuple[int, int]]]  # per chunk, (token, expert) pairs kept
    dropped: list[int]  # per chunk, (token, expert) choices dropped
    aux: Tensor
    seq_aux: Tensor
    z: Tensor


def reference_moe(
    chunks: list[Tensor], w: FullWeights, cfg: MoEConfig, global_aux: bool = False
) -> Reference:
    """The MoE layer on each chunk ``[s, b, h]`` (one per rank, or per dp replica).

    A chunk is the unit of capacity and of the balancing losses (the tokens one router
    call sees together); the losses are summed over the chunks. With ``global_aux`` the
    switch-style loss is taken once over the tokens of all chunks together.
    """
    rc = cfg.router
    e, k = rc.num_experts, rc.top_k
    outputs, kept_all, dropped = [], [], []
    aux = seq_aux = z = torch.zeros(())
    all_counts, all_p, all_n = torch.zeros(e), torch.zeros(e), 0
    for chunk in chunks:
        s, b, h = chunk.shape
        tokens = chunk.reshape(-1, h)
        n = tokens.shape[0]
        logits = torch.stack([w.router @ tokens[t] for t in range(n)])  # [N, E]
        choices = []
        for t in range(n):
            idx, weights = route_token(logits[t], rc, w.bias)
            choices.append(list(zip(idx, weights, strict=True)))
        capacity = None if rc.capacity_factor is None else capacity_of(rc, n)
        if capacity is None:
            kept = {(t, x) for t, row in enumerate(choices) for x, _ in row}
        else:
            plain = [[(x, float(wt)) for x, wt in row] for row in choices]
            kept = drop_rule(plain, e, capacity, rc.drop_policy)
        rows = []
        for t in range(n):
            y = torch.zeros(h)
            for x, wt in choices[t]:
                if (t, x) in kept:
                    y = y + wt * expert_mlp(tokens[t], w.w1[x], w.w2[x], cfg.gated)
            rows.append(y)
        out = torch.stack(rows).view(s, b, h)
        if w.shared1 is not None and w.shared2 is not None:
            shared = torch.stack(
                [expert_mlp(tokens[t], w.shared1, w.shared2, cfg.gated) for t in range(n)]
            )
            if w.gate is not None:
                shared = shared * torch.sigmoid(tokens @ w.gate.t())
            out = out + shared.view(s, b, h)
        outputs.append(out)
        kept_all.append(kept)
        dropped.append(n * k - len(kept))
        p = balance_scores(logits, rc)  # [N, E]
        counts = torch.zeros(e)
        for row in choices:
            for x, _ in row:
                counts[x] += 1
        all_counts, all_p, all_n = all_counts + counts, all_p + p.sum(dim=0), all_n + n
        if rc.aux_loss_coeff and not global_aux:
            f = counts / (n * k)
            aux = aux + rc.aux_loss_coeff * e * (f * p.mean(dim=0)).sum()
        if rc.seq_aux_loss_coeff:
            per_seq = torch.zeros(())
            for j in range(b):
                ts = [si * b + j for si in range(s)]
                cj = torch.zeros(e)
                for t in ts:
                    for x, _ in choices[t]:
                        cj[x] += 1
                f = cj * e / (k * s)
                per_seq = per_seq + (f * p[ts].mean(dim=0)).sum()
            seq_aux = seq_aux + rc.seq_aux_loss_coeff * per_seq / b
        if rc.z_loss_coeff:
            z = z + rc.z_loss_coeff * torch.logsumexp(logits, dim=-1).square().mean()
    if rc.aux_loss_coeff and global_aux:
        f = all_counts / (all_n * k)
        aux = rc.aux_loss_coeff * e * (f * all_p / all_n).sum()
    return Reference(outputs, kept_all, dropped, aux, seq_aux, z)


def capacity_of(rc: RouterConfig, n: int) -> int:
    """The capacity rule, written out."""
    assert rc.capacity_factor is not None
    return math.ceil(rc.capacity_factor * n * rc.top_k / rc.num_experts)
