"""What the trainer logs of an MoE model: the router losses and how evenly experts are loaded."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mega_models import GPTModel, HybridModel
from mega_moe import MoELayer
from mega_parallel_grid import ProcessGroups

__all__ = ["moe_log_values"]


def moe_log_values(
    chunks: Sequence[GPTModel | HybridModel], groups: ProcessGroups
) -> dict[str, float]:
    """Router loss and per-expert load of the last micro-batch, over the whole model.

    Call it on every rank after a training step (one all-reduce over the world; nothing
    for a dense model, which gives ``{}``). Per MoE layer the load is the number of
    (token, expert) assignments each expert received, summed over all ranks' tokens of
    the step's last micro-batch (after any capacity dropping). Returns:

    - ``moe_aux_loss``: the router losses (switch, sequence-level and z-loss), summed
      over the MoE layers, of a micro-batch (mean over the dp ranks);
    - ``moe_load_min`` / ``moe_load_max``: the smallest and largest share of a layer's
      assignments that one expert got, over all layers and experts (balanced: 1/E);
    - ``moe_imbalance``: the largest ``max / mean`` load of any layer (balanced: 1).

    A GPT's MTP depths count as layers ``num_layers + k`` when their layer is MoE (the kind
    of the decoder's last layer).
    """
    if not chunks or not chunks[0].config.is_moe:
        return {}
    config = chunks[0].config
    device = next(chunks[0].parameters()).device
    depth = config.mtp_num_layers if config.is_moe_layer(config.num_layers - 1) else 0
    layers, experts = config.num_layers + depth, config.num_experts
    counts = torch.zeros(layers, experts, dtype=torch.float64, device=device)
    aux = torch.zeros(layers, dtype=torch.float64, device=device)
    for chunk in chunks:
        rows = [(int(index), layer) for index, layer in chunk.layers.items()]
        mtp = getattr(chunk, "mtp", None)
        rows += [(config.num_layers + k, d.layer) for k, d in enumerate(mtp or [])][:depth]
        for index, layer in rows:
            moe = getattr(layer, "mlp", None)
            if isinstance(moe, MoELayer) and moe.last_stats is not None:
                counts[index] = moe.last_stats.tokens_per_expert.to(torch.float64)
                aux[index] = moe.last_stats.loss.detach().to(torch.float64)
    flat = torch.cat([counts.flatten(), aux])  # [L*E + L]
    if dist.get_world_size(groups.world) > 1:
        dist.all_reduce(flat, group=groups.world)  # layers over pp; shares over tp x cp; dp
    moe_rows = [*config.moe_layers, *range(config.num_layers, layers)]
    counts = flat[: layers * experts].view(layers, experts)[moe_rows]
    total_aux = flat[layers * experts :].sum() / groups.size("dp")
    per_layer = counts.sum(dim=1, keepdim=True).clamp_min(1.0)  # [moe layers, 1]
    shares = counts / per_layer
    return {
        "moe_aux_loss": float(total_aux),
        "moe_load_min": float(shares.min()),
        "moe_load_max": float(shares.max()),
        "moe_imbalance": float((shares.max(dim=1).values * experts).max()),
    }
