"""The resolved plan of a run: every value derived from the config and the world size, once.

``plan_for`` computes it (no process, no tensor); ``validate.check_config`` checks the whole
config against it and returns it; the trainer, ``--dry-run``, the estimate and the bench
read dp, micro-batches, tokens per step, the local sequence and the stage split from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mega_models import GPTConfig
from mega_models.spec import LayoutRequest, ModelSpec, resolve_model, spec_for
from mega_models.stages import stage_layer_counts
from mega_parallel_grid import ParallelConfig, RankLayout
from mega_pipeline import dualpipev_order, unit_times, zbv_order
from mega_pretrain.config import TrainerConfig

__all__ = ["Plan", "plan_for"]


@dataclass(frozen=True)
class Plan:
    """One run's model, family and layout, and the numbers derived from them."""

    config: TrainerConfig
    """The config the plan was made from."""
    model: GPTConfig
    """The resolved model config (size + overrides)."""
    spec: ModelSpec[Any]
    """The model's family."""
    layout: RankLayout
    """Ranks of every parallel dimension; ``layout.config`` is the ParallelConfig."""
    stage_layers: tuple[int, ...]
    """Layers of each virtual stage, in pipeline order (``pp * vpp`` counts)."""

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def parallel(self) -> ParallelConfig:
        return self.layout.config

    @property
    def dp(self) -> int:
        """Data-parallel size: what the world size leaves after tp x cp x pp."""
        return self.layout.dp

    @property
    def microbatches(self) -> int:
        """Micro-batches per optimizer step on each dp rank (needs a concrete micro-batch)."""
        t = self.config.train
        return t.global_batch_size // (t.micro_batch_size * self.dp)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over all dp ranks."""
        return self.config.train.global_batch_size * self.config.train.seq_len

    @property
    def local_seq_len(self) -> int:
        """Tokens of a sample on one cp rank."""
        return self.config.train.seq_len // self.parallel.cp

    @property
    def rank_layers(self) -> tuple[int, ...]:
        """Layers held by each pp rank (the sum of its virtual stages)."""
        pp, chunks = self.parallel.pp, self.parallel.vpp or 1
        if self.config.parallel.pp_schedule in ("zbv", "dualpipev"):  # the V
            return tuple(
                self.stage_layers[r] + self.stage_layers[2 * pp - 1 - r] for r in range(pp)
            )
        return tuple(sum(self.stage_layers[c * pp + r] for c in range(chunks)) for r in range(pp))

    @property
    def layout_request(self) -> LayoutRequest:
        """What the family's layout check reads."""
        p, t = self.config.parallel, self.config.train
        return LayoutRequest(
            parallel=self.parallel, local_seq_len=self.local_seq_len, sequence_parallel=p.sequence_parallel,
            fp8=t.fp8, tp_comm_overlap=p.tp_comm_overlap,
        )  # fmt: skip

    @property
    def schedule_name(self) -> str:
        """The pipeline schedule the trainer runs for this layout."""
        p = self.parallel
        if p.pp == 1:
            return "no pipelining"
        if self.config.parallel.pp_schedule == "zb-h1":
            return "ZB-H1 (1F1B, weight gradients deferred)"
        if self.config.parallel.pp_schedule == "zbv":
            return "ZBV (two chunks in a V, weight gradients deferred)"
        if self.config.parallel.pp_schedule == "dualpipev":
            return "DualPipeV (two chunks in a V, each F&B pair one step)"
        return f"interleaved 1F1B (vpp {p.vpp})" if p.vpp and p.vpp > 1 else "1F1B"

    @property
    def bubble_fraction(self) -> float:
        """Share of a step's time the pipeline idles, as the schedule predicts it.

        1F1B: ``(p - 1) / (m + p - 1)`` for ``p`` stages and ``m`` micro-batches; the
        interleaved schedule shrinks the bubble ``vpp`` times: ``(p - 1) / (vpp * m + p - 1)``
        (the ``(p - 1) / (vpp * m)`` of bubble to work, as a share of the step). ZB-H1:
        ``(p - 1) / (3m + p - 1)`` with equal F, B and W times (the order's figure, unmeasured
        on GPUs). ZBV, DualPipeV: the idle share of all ranks' orders replayed together with
        equal F, B and W chunk passes (``1 - 6m / units``; ``(p - 1) / (6m + p - 1)`` for
        the cases the pipeline tests check). 0 without a pipeline; needs a concrete
        micro-batch.
        """
        p, m = self.parallel.pp, self.microbatches
        chunks = self.parallel.vpp or 1
        v_order = {"zbv": zbv_order, "dualpipev": dualpipev_order}.get(
            self.config.parallel.pp_schedule
        )
        if v_order is not None and p > 1:
            starts = unit_times([v_order(p, r, m) for r in range(p)], 2, v_shape=True)
            return 1 - 6 * m / (max(max(s) for s in starts) + 1)
        if self.config.parallel.pp_schedule == "zb-h1":  # F = B = W: p - 1 idle units of 3m + p - 1
            return (p - 1) / (3 * m + p - 1)
        return (p - 1) / (chunks * m + p - 1)

    @property
    def total_tokens(self) -> int:
        """Tokens the whole run trains on (``train.steps`` optimizer steps)."""
        return self.config.train.steps * self.tokens_per_step

    def flops_per_token(self) -> float:
        """Model FLOPs per token (forward + backward) at ``train.seq_len``, for MFU."""
        return self.spec.flops_per_token(self.model, self.config.train.seq_len)

    def describe(self) -> list[str]:
        """The plan's lines for ``--dry-run``."""
        p, t = self.parallel, self.config.train
        lines = [
            f"model family: {self.spec.name}",
            f"world size {self.world_size}: tp {p.tp}, pp {p.pp}, cp {p.cp}, dp {self.dp}, "
            f"ep {p.ep}, etp {p.expert_tp}, vpp {p.vpp}",
            f"stage layers (per virtual stage): {list(self.stage_layers)}",
        ]
        if t.micro_batch_size > 0:
            lines.append(
                f"batch: {self.microbatches} micro-batch(es) of {t.micro_batch_size} per dp rank "
                f"per step, {self.tokens_per_step} tokens per step, {self.local_seq_len} "
                "tokens per sample on each cp rank"
            )
            lines.append(
                f"pipeline schedule: {self.schedule_name}, predicted bubble "
                f"{self.bubble_fraction:.1%} of each step"
                + (f" (pp {p.pp}, {self.microbatches} micro-batches)" if p.pp > 1 else "")
            )
        lines.append(
            f"job: {t.steps:,} steps of {self.tokens_per_step:,} tokens = "
            f"{self.total_tokens:,} tokens"
        )
        return lines


def resolve_model_config(config: TrainerConfig) -> GPTConfig:
    """The registered size with the config's overrides applied (any family)."""
    return resolve_model(config.model.size, dict(config.model.overrides))


def plan_for(config: TrainerConfig, world_size: int, model: GPTConfig | None = None) -> Plan:
    """The plan of ``config`` on ``world_size`` ranks (``model``: the resolved model, if the
    caller has it). Raises one sentence for degrees the world size or the layers cannot take;
    the rest of the config is checked by ``validate.check_config``."""
    model = resolve_model_config(config) if model is None else model
    layout = RankLayout(world_size, config.parallel.parallel_config())
    p = config.parallel
    stages = stage_layer_counts(
        model.num_layers, p.pp, p.vpp, p.pp_layers or None, split_name="parallel.pp_layers"
    )
    return Plan(config=config, model=model, spec=spec_for(model), layout=layout,
                stage_layers=stages)  # fmt: skip
