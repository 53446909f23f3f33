"""One ``ModelSpec`` per model family, and the registry the trainer reads them from.

A spec says everything a trainer, a dry run, a benchmark or a converter needs to know about
a family without testing its type: the config and model classes, the named sizes, FLOPs per
token, parameter counts (total and per rank for a layout), the checks a layout must pass,
how one pipeline chunk is built, and the Hugging Face adapter (or None). The families are
registered in :mod:`mega_models.families`; a new family is a module and one line there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from mega_models.config import GPTConfig
from mega_models.flops import attention_norm_params, replicated_attention_params
from mega_models.stages import StageSpec
from mega_parallel_grid import ParallelConfig, ProcessGroups

__all__ = [
    "HFAdapter",
    "LayoutRequest",
    "ModelSpec",
    "all_specs",
    "check_common_layout",
    "hf_spec",
    "register_spec",
    "resolve_model",
    "spec_for",
]

C = TypeVar("C", bound=GPTConfig)


@dataclass(frozen=True)
class LayoutRequest:
    """How a run wants to cut and run a model: what a family's layout check reads."""

    parallel: ParallelConfig
    """The parallel degrees (tp, pp, cp, ep, etp, vpp)."""
    local_seq_len: int
    """Tokens of a sample on one cp rank (``seq_len / cp``)."""
    sequence_parallel: bool = False
    """Norms and dropout split along the sequence over tp."""
    fp8: bool = False
    """Linear GEMMs in FP8."""
    tp_comm_overlap: bool = False
    """Sequence-parallel collectives overlapped with the GEMMs."""


@dataclass(frozen=True)
class HFAdapter:
    """The Hugging Face bridge of a family: import and export of its checkpoints."""

    architectures: tuple[str, ...]
    """The ``architectures`` entries of config.json this adapter reads."""
    config_from_hf: Callable[[Path], GPTConfig]
    """The model config of a Hugging Face model folder."""
    load_weights: Callable[[Any, Path], None]
    """Copy a folder's weights into one built chunk (this rank's shards)."""
    gather_state: Callable[[Sequence[Any], ProcessGroup], dict[str, Tensor] | None]
    """Every parameter of this rank's chunks as full tensors (on the first stage; else None)."""
    save: Callable[..., Any]
    """Write a gathered state as a Hugging Face folder: ``save(state, out_dir, config=,
    base_config=)``."""
    check_base_config: Callable[[GPTConfig, Path, str], None]
    """Raise when a kept config.json describes other dimensions than the model's."""


def _no_extra_params(config: GPTConfig) -> int:
    return 0


def check_common_layout(config: GPTConfig, request: LayoutRequest) -> None:
    """The checks every family built from GPTConfig's fields shares: heads, FFN and experts
    against tp, ep and etp. One sentence naming the values, as ``ValueError``."""
    p = request.parallel
    for label, count in (
        ("num_attention_heads", config.num_attention_heads),
        ("num_query_groups", config.kv_heads),
    ):
        if count % p.tp:
            raise ValueError(
                f"model.{label} ({count}) is not divisible by tp ({p.tp}); choose tp dividing {count}"
            )
    dense_layers = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    if dense_layers and config.ffn_size % p.tp:
        raise ValueError(
            f"the FFN size (model.ffn_hidden_size, {config.ffn_size}) is not divisible by tp "
            f"({p.tp}); choose a multiple of {p.tp}"
        )
    if p.ep > 1 and not config.is_moe:
        raise ValueError(
            f"ep ({p.ep}) > 1 needs an MoE model; this GPT has no expert layers "
            "(set model.num_experts, or ep 1)"
        )
    if config.is_moe:
        _check_moe_layout(config, request)


def _check_moe_layout(config: GPTConfig, request: LayoutRequest) -> None:
    p, etp = request.parallel, request.parallel.expert_tp
    if config.num_experts % p.ep:
        raise ValueError(
            f"model.num_experts ({config.num_experts}) is not divisible by ep ({p.ep}); "
            f"choose ep dividing {config.num_experts}"
        )
    if config.moe_ffn_size % etp:
        raise ValueError(
            f"the expert FFN size (model.moe_ffn_hidden_size, {config.moe_ffn_size}) is not "
            f"divisible by etp ({etp}); choose etp dividing it"
        )
    if config.moe_shared_expert_size % p.tp:
        raise ValueError(
            f"model.moe_shared_expert_size ({config.moe_shared_expert_size}) is not divisible "
            f"by tp ({p.tp}); choose a multiple of {p.tp}"
        )
    local = request.local_seq_len
    if p.tp > 1 and not request.sequence_parallel and local % p.tp:
        raise ValueError(
            f"MoE layers split each cp rank's sequence ({local} tokens) over tp ({p.tp}); "
            f"choose train.seq_len so that it is divisible by {p.tp * p.cp}"
        )


@dataclass(frozen=True)
class ModelSpec(Generic[C]):
    """Everything the trainer needs to know about one model family."""

    name: str
    """The family's name (``gpt``, ``hybrid``)."""
    config_class: type[C]
    """Its config dataclass (a GPTConfig subclass or GPTConfig itself)."""
    model_class: type[nn.Module]
    """Its model (one pipeline chunk): ``model_class(config, groups, stage=..., ...)``."""
    sizes: Mapping[str, C]
    """Its named sizes."""
    flops_per_token: Callable[[C, int], float]
    """Forward + backward FLOPs per token at a sequence length, for MFU."""
    matmul_params: Callable[[C], int]
    """Weights that take part in matmuls, the output layer included (every routed expert)."""
    build_chunk: Callable[..., nn.Module]
    """``build_chunk(config, groups, stage, *, sequence_parallel, recompute, seed, rng,
    device, dtype, cp_method, fp8, tp_comm_overlap)``: one pipeline chunk."""
    check_layout: Callable[[C, LayoutRequest], None] = check_common_layout
    """Raise one sentence when the model cannot run as ``request`` asks."""
    extra_params: Callable[[C], int] = _no_extra_params
    """Parameters beside the matmul weights, embeddings and norms (Mamba's conv, A, D...)."""
    norms_per_layer: int = 2
    """Pre-norms per layer (GPT: before attention and before the MLP)."""
    hf: HFAdapter | None = None
    """The Hugging Face bridge, or None when the family has none."""
    adopt: Callable[[GPTConfig, Mapping[str, Any], str], C | None] | None = None
    """Make a config of this family from another family's size ``(base, overrides, size)``
    when the overrides ask for it (a GPT size given a hybrid ``pattern``), else None."""
    title: str = field(default="")
    """How error sentences name the family (default: its name)."""

    def total_params(self, config: C) -> int:
        """Every parameter of the model (embedding, norms, positions, output, layers)."""
        h, vocab = config.hidden_size, config.vocab_size
        norms = (self.norms_per_layer * config.num_layers + 1) * h
        norms *= 2 if config.norm == "layernorm" else 1
        norms += config.num_layers * attention_norm_params(config)
        positions = config.max_seq_len * h if config.position == "learned" else 0
        output = 0 if config.tie_embeddings else vocab * h
        layers = self.matmul_params(config) - vocab * h + self.extra_params(config)
        return vocab * h + output + norms + positions + layers

    def routed_expert_params(self, config: C) -> int:
        """Weights of every routed expert of every MoE layer (split over ep x etp, not tp)."""
        if not config.is_moe:
            return 0
        per_expert = (3 if config.activation == "swiglu" else 2) * config.hidden_size
        return len(config.moe_layers) * config.num_experts * per_expert * config.moe_ffn_size

    def params_per_rank(
        self, config: C, parallel: ParallelConfig, layers: float
    ) -> tuple[int, int]:
        """``(dense, expert)`` parameters of a rank holding ``layers`` layers of the busiest
        pipeline stage: the dense part split over tp, the routed experts over ep x etp. The
        rank also holds the embedding or the output layer (both, and a tied copy, at pp 1)."""
        experts = self.routed_expert_params(config)
        vocab = config.vocab_size * config.hidden_size
        matrices = 1 if config.tie_embeddings else 2  # input embedding and output layer
        total = self.total_params(config)
        per_layer = (total - experts - matrices * vocab) / config.num_layers
        embed = vocab * (matrices if parallel.pp == 1 else 1)
        whole = replicated_attention_params(config)  # MLA's down-projections: not split
        dense = int(((per_layer - whole) * layers + embed) / parallel.tp + whole * layers)
        expert = int(experts / parallel.pp / (parallel.ep * parallel.expert_tp))
        return dense, expert

    def build(
        self, config: C, groups: ProcessGroups, stage: StageSpec, **options: Any
    ) -> nn.Module:
        """One pipeline chunk of ``config`` (see :attr:`build_chunk` for the options)."""
        return self.build_chunk(config, groups, stage, **options)


_REGISTRY: dict[str, ModelSpec[Any]] = {}


def register_spec(spec: ModelSpec[Any]) -> ModelSpec[Any]:
    """Add a family; its name and its sizes' names must be new."""
    if spec.name in _REGISTRY:
        raise ValueError(f"a model family named {spec.name!r} is already registered")
    taken = sorted(set(spec.sizes) & {n for s in _REGISTRY.values() for n in s.sizes})
    if taken:
        raise ValueError(
            f"model family {spec.name!r} registers sizes {', '.join(taken)} that another "
            "family already has; rename them"
        )
    _REGISTRY[spec.name] = spec
    return spec


def all_specs() -> Iterator[ModelSpec[Any]]:
    """Every registered family, in registration order."""
    import mega_models.families  # noqa: F401  (registers the built-in families)

    yield from _REGISTRY.values()


def spec_for(size_or_config: str | GPTConfig) -> ModelSpec[Any]:
    """The family of a size name or of a config (its most specific registered class)."""
    specs = list(all_specs())
    if isinstance(size_or_config, str):
        for spec in specs:
            if size_or_config in spec.sizes:
                return spec
        known = ", ".join(n for s in specs for n in s.sizes)
        raise ValueError(f"unknown model size {size_or_config!r}; known sizes: {known}")
    by_class = {s.config_class: s for s in specs}
    for cls in type(size_or_config).__mro__:
        if cls in by_class:
            return by_class[cls]
    raise ValueError(
        f"no model family is registered for {type(size_or_config).__name__}; register a "
        "ModelSpec for it (mega_models.register_spec)"
    )


def resolve_model(size: str, overrides: Mapping[str, Any]) -> GPTConfig:
    """The registered ``size`` with ``overrides`` applied; another family may adopt it
    (a GPT size with a hybrid ``pattern`` becomes the hybrid of that size's dimensions)."""
    owner = spec_for(size)
    base = owner.sizes[size]
    for spec in all_specs():
        if spec is not owner and spec.adopt is not None:
            adopted: GPTConfig | None = spec.adopt(base, overrides, size)
            if adopted is not None:
                return adopted
    changed: GPTConfig = base.replace(**overrides)
    return changed


def hf_spec(hf_dir: Path) -> ModelSpec[Any]:
    """The family whose Hugging Face adapter reads the model folder ``hf_dir``."""
    from mega_models.hf import read_hf_config

    bridged = [s for s in all_specs() if s.hf is not None]
    if not bridged:
        raise ValueError("no registered model family has a Hugging Face adapter")
    try:
        names = read_hf_config(hf_dir).get("architectures") or []
    except ValueError:
        return bridged[0]  # its reader says what is wrong with the folder
    for spec in bridged:
        assert spec.hf is not None
        if any(n in spec.hf.architectures for n in names):
            return spec
    return bridged[0]  # its reader names the architectures it knows
