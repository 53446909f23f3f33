"""``train.micro_batch_size = 0``: the largest micro-batch the memory estimate fits on the device."""

from __future__ import annotations

from dataclasses import replace

from mega_models import GPTConfig
from mega_pretrain.config import TrainerConfig
from mega_pretrain.estimate import estimate
from mega_pretrain.plan import plan_for

__all__ = ["HEADROOM", "resolve_micro_batch"]

#: Share of the device's memory the estimate may fill (the rest: allocator slack, NCCL
#: buffers, compile workspaces; the estimate was within 2 % of the measured peak on H200).
HEADROOM = 0.9


def resolve_micro_batch(
    config: TrainerConfig, model: GPTConfig, world_size: int, device_bytes: int | None
) -> tuple[TrainerConfig, str | None]:
    """``config`` with a concrete micro-batch size, and a line saying how it was chosen.

    A non-zero ``train.micro_batch_size`` is kept (the line is None). Zero means auto: the
    largest micro-batch that divides each dp rank's share of the global batch (and, with
    interleaving, leaves a multiple of pp micro-batches) whose estimated memory per rank
    (:func:`~mega_pretrain.estimate.estimate`, per ``parallel.sharding`` stage, with ZeRO-2/3's
    memory in flight) stays within :data:`HEADROOM` of the budget — ``run.memory_gib`` if set, else
    ``device_bytes`` (the GPU's memory). Raises one sentence when nothing fits.
    """
    t, p = config.train, config.parallel
    if t.micro_batch_size != 0:
        return config, None
    if config.run.memory_gib is not None:
        if not config.run.memory_gib > 0:
            raise ValueError(
                f"run.memory_gib ({config.run.memory_gib}) must be positive: the memory of one "
                "device in GiB, e.g. 139.8 for an H200"
            )
        budget = config.run.memory_gib * 2**30
    elif device_bytes is not None:
        budget = float(device_bytes)
    else:
        raise ValueError(
            "train.micro_batch_size 0 (auto) needs the device's memory, and there is no GPU; "
            "set run.memory_gib or a micro_batch_size"
        )
    plan = plan_for(config, world_size, model)
    dp = plan.dp
    if t.global_batch_size < dp or t.global_batch_size % dp:
        raise ValueError(
            f"train.global_batch_size ({t.global_batch_size}) is not divisible by dp ({dp}); "
            f"choose a multiple of {dp}"
        )
    share = t.global_batch_size // dp
    candidates = [m for m in range(share, 0, -1) if share % m == 0]
    if p.vpp:
        candidates = [m for m in candidates if (share // m) % p.pp == 0]
    smallest = None
    for micro in candidates:
        trial = replace(config, train=replace(t, micro_batch_size=micro))
        need = estimate(replace(plan, config=trial)).total
        smallest = need
        if need <= HEADROOM * budget:
            line = (
                f"micro_batch_size auto: {micro} (estimate {need / 2**30:.1f} GiB of "
                f"{HEADROOM:.0%} x {budget / 2**30:.1f} GiB per device)"
            )
            return trial, line
    need_text = f"{smallest / 2**30:.1f} GiB" if smallest is not None else "more"
    raise ValueError(
        f"train.micro_batch_size 0 (auto) finds no micro-batch that fits: the smallest needs "
        f"{need_text} of {HEADROOM:.0%} x {budget / 2**30:.1f} GiB per device; raise tp or pp, "
        "turn on train.recompute, or lower train.seq_len"
    )
