"""The trainer's configuration: nested frozen dataclasses, a TOML file and dotted overrides.

Every field has a docstring; ``--dry-run`` prints the resolved config. Loading never runs
code: TOML is parsed with ``tomllib``, values are converted to each field's declared type
and checked before any process group exists.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from mega_parallel_grid import ParallelConfig

__all__ = ["CheckpointConfig", "DataConfig", "ModelSection", "ParallelSection", "RunConfig",
           "TrainConfig", "TrainerConfig", "config_to_dict", "load_config"]  # fmt: skip


@dataclass(frozen=True)
class ModelSection:
    """Which model: a registered size, optionally with fields of GPTConfig changed."""

    size: str = "tiny"
    """A name from mega_models' registry (tiny, 125m, 1b, 1b-bench, 8b)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """GPTConfig fields to change, e.g. ``--model.num_layers 8`` lands here."""


#: Megatron-FSDP's ``data_parallel_sharding_strategy`` names for ``parallel.sharding``.
_SHARDING_ALIASES = {"optim": "optimizer", "optim_grads": "gradients",
                     "optim_grads_params": "parameters"}  # fmt: skip


@dataclass(frozen=True)
class ParallelSection:
    """How the model is cut across ranks; dp is what is left of the world size."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    cp: int = 1
    """Context-parallel size."""
    ep: int = 1
    """Expert-parallel size (MoE models)."""
    etp: int | None = None
    """Expert tensor-parallel size (default: tp)."""
    vpp: int | None = None
    """Virtual pipeline chunks per pp rank (interleaved 1F1B)."""
    pp_schedule: Literal["auto", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"] = "auto"
    """Pipeline schedule: ``auto`` (interleaved with vpp > 1, else 1F1B), ``1f1b``,
    ``interleaved`` (needs vpp > 1), ``zb-h1`` (1F1B with the linears' weight gradients
    deferred into the cool-down; vpp unset), ``zbv`` (zero bubble in a V) or ``dualpipev``
    (DeepSeek's V-shaped DualPipe; at least 2 pp micro-batches). The V schedules need vpp 2:
    rank r holds virtual stages r and 2 pp - 1 - r, so rank 0 holds the embedding and the
    output layer."""
    dualpipev_overlap: bool = True
    """Under ``pp_schedule dualpipev``: run each F&B pair as one overlapped step where the
    model chunk offers it (GPT chunks: one micro-batch's forward interleaved layer by layer
    with the other's backward, MoE dispatch/combine all-to-alls in flight behind the other's
    compute); false: the pair's forward, then its backward. Only for dualpipev."""
    pp_layers: tuple[int, ...] = ()
    """Layers per virtual stage, in pipeline order (``pp * vpp`` counts adding up to the
    layers), e.g. ``13,11`` to give the last stage, which also holds the output layer and
    the loss, fewer; empty: an even split."""
    sequence_parallel: bool = False
    """Split norms and dropout along the sequence over tp (needs tp > 1)."""
    tp_comm_overlap: bool = False
    """Overlap the sequence-parallel all-gathers/reduce-scatters with the linear GEMMs, in
    chunks around a ring of the tp group (GPT models; needs sequence_parallel and tp > 1)."""
    cp_method: Literal["ring", "all_gather"] = "ring"
    """How context-parallel attention exchanges K/V."""
    distributed_optimizer: bool = True
    """Shard optimizer state over dp (ZeRO-1) instead of replicating it."""
    sharding: Literal[
        "optimizer", "gradients", "parameters", "optim", "optim_grads", "optim_grads_params"
    ] = "optimizer"
    """What else each dp rank keeps only its shard of, beside the optimizer state (needs
    distributed_optimizer): ``optimizer`` (ZeRO-1: 2 + 4 + 12/dp bytes per bf16 parameter
    with AdamW), ``gradients`` (ZeRO-2: reduce-scattered gradient shards, each bucket's full
    gradients freed once reduced; 2 + 16/dp) or ``parameters`` (ZeRO-3, FSDP: parameter
    shards, each transformer layer all-gathered before its forward and its backward and freed
    after, the next one prefetched; 18/dp). Megatron-FSDP's names ``optim``, ``optim_grads``
    and ``optim_grads_params`` are accepted as aliases."""
    dp_shard: int | None = None
    """HSDP: shard over groups of this many dp ranks and replicate across the dp / dp_shard
    groups (Megatron's ``num_distributed_optimizer_instances`` = dp / dp_shard); every
    ``sharding`` stage shards within the group, gradients are then all-reduced across the
    replicas. Unset: shard over all of dp."""
    optimizer_offload: bool = False
    """Keep the fp32 master weights and the Adam moments in host memory (pinned on a GPU) and
    run the update on the CPU (torch's fused AdamW) on a background thread, overlapped with
    the next step's forward (each layer waits only for its own shard to be updated and
    copied up; run in step where a weight tied across pp stages is read outside its
    module): 12 (or 16 under ZeRO-2/3) fewer device bytes per parameter and rank, for a model
    that does not fit otherwise (needs distributed_optimizer)."""
    overlap_grad_reduce: bool = True
    """Start each gradient bucket's reduction during backward."""
    wgrad_into_main_grad: bool = True
    """Under ZeRO-1 (``sharding: optimizer``) with fp32 gradients, the grouped experts and
    the transformer blocks' bf16 linears (attention, MLA, MLP, Mamba projections; not fp8
    ones) add their weight gradients straight into the fp32 gradient buffer inside their
    backward (Megatron's gradient accumulation fusion): no bf16 gradient written and read
    again per micro-batch. Off under CUDA graphs (``train.compile_mode reduce-overhead``).
    False: every gradient goes through ``.grad`` (for A/B measurement)."""
    overlap_param_gather: bool = False
    """All-gather updated parameters during the next forward (distributed optimizer)."""
    bucket_size: int = 40_000_000
    """Gradient bucket size in elements."""

    def resolved_pp_schedule(self) -> str:
        """``pp_schedule`` with ``auto`` resolved; ValueError for a choice the layout cannot run."""
        chunks, choice = self.vpp or 1, self.pp_schedule
        if choice == "auto":
            return "interleaved" if chunks > 1 else "1f1b"
        if choice in ("zbv", "dualpipev"):
            if self.vpp != 2:
                raise ValueError(
                    f"parallel.pp_schedule {choice!r} runs two chunks per rank in a V, but vpp "
                    f"is {self.vpp}; set --parallel.vpp 2"
                )
        elif (choice == "interleaved") != (chunks > 1):
            raise ValueError(
                f"parallel.pp_schedule {choice!r} with vpp {self.vpp}: 'interleaved' needs "
                "vpp > 1 and '1f1b'/'zb-h1' run one chunk per rank; set vpp to match"
            )
        if self.pp == 1 and choice != "1f1b":
            raise ValueError(
                f"parallel.pp_schedule {choice!r} needs pp > 1; set --pp or use '1f1b'/'auto'"
            )
        return choice

    @property
    def zero_stage(self) -> str:
        """``sharding`` with Megatron-FSDP's aliases resolved: optimizer, gradients or parameters."""
        return _SHARDING_ALIASES.get(self.sharding, self.sharding)

    def parallel_config(self) -> ParallelConfig:
        """The degrees as mega-parallel-grid's ParallelConfig (validated there)."""
        return ParallelConfig(tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, etp=self.etp,
                              vpp=self.vpp, dp_shard=self.dp_shard)  # fmt: skip


@dataclass(frozen=True)
class TrainConfig:
    """The optimisation: batch, schedule, precision."""

    steps: int = 300
    """Optimizer steps to run."""
    seq_len: int = 128
    """Tokens per sample."""
    micro_batch_size: int = 8
    """Samples per micro-batch on each dp rank; 0 picks the largest that the memory estimate
    fits on the device (see ``run.memory_gib``)."""
    global_batch_size: int = 16
    """Samples per optimizer step over all dp ranks (micro * dp * accumulation)."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of decay."""
    warmup_steps: int | None = None
    """Linear warm-up steps (at most ``steps``); unset: 20, or a tenth of ``steps`` when that
    is fewer (see ``warmup``)."""
    decay: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """Shape of the decay after warm-up (wsd: constant, then linear decay at the end)."""
    wsd_decay_fraction: float = 0.2
    """Fraction of the steps spent decaying, for the wsd schedule."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    seed: int = 1234
    """Seed of initialisation, data order and dropout."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Parameter/compute dtype; bf16/fp16 keep fp32 master weights. ``auto``: bf16 on a GPU
    that supports it, fp32 on CPU (the start-up line and ``--dry-run`` say which)."""
    tf32: bool = True
    """On a GPU, let fp32 matmuls and convolutions use TF32 tensor cores (about 10-bit
    mantissa products, fp32 sums); false keeps full fp32 products."""
    attention_kernel: Literal["auto", "flash", "cudnn", "efficient", "fa4"] = "auto"
    """On a GPU, the SDPA kernel tried first for causal attention: ``auto`` keeps torch's
    own order, ``cudnn`` cuDNN's fused attention, ``flash`` FlashAttention-2, ``efficient``
    (memory-efficient), ``fa4`` FlashAttention-4 behind the flash backend (the optional
    ``flash-attn-4`` package, Hopper or Blackwell; not yet run on a GPU); torch falls back
    to the next in its order for a shape or mask the first cannot take. On the H200 with
    torch 2.11, ``auto`` ran cuDNN's kernels in the compiled step, and alone at 1b-bench's
    shape FlashAttention-2 and cuDNN took the same time (bench/RESULTS.md, 2026-12-02). MLA's value head narrower than its query's is the
    exception: cuDNN runs it where it takes unequal dims (sm90+, cuDNN 9.10+), whatever this
    says, as FlashAttention-2 would need the values padded (1.04x the step on
    ``deepseek-v3-3b``, 2026-12-07); elsewhere the values are padded and this order applies."""
    fp8: bool = False
    """Run the transformer layers' linear GEMMs in FP8 (needs bf16; GPT models only)."""
    fp8_recipe: Literal["tensor", "row", "block"] = "tensor"
    """FP8 scaling with ``train.fp8``: one scale per tensor, per row (torchao's rowwise), or
    per 1x128 activation tile and 128x128 weight block (DeepSeek-V3; tp shards of the
    layers' split dimensions must be multiples of 128). Each runs eager or compiled (on the
    GPU each compiled layer matched eager gradient for gradient, bench/RESULTS.md). Compiled
    on an H100, `1b-bench` ran tensor-wise at 1.17x bf16 and row-wise at 1.08x."""
    fp8_amax_history: int = 0
    """With ``train.fp8`` and the tensor recipe: 0 scales each GEMM operand by its current
    amax; n > 0 scales the layers' inputs and output gradients by the max amax of the last
    n steps (delayed scaling, Megatron's ``fp8_amax_history_len``), so under
    ``torch.compile`` the casts can fuse into the kernels producing those tensors. The
    first step scales by the current amax; the histories are maxed over tp x dp x cp once a
    step (every layout scales as one process does) and saved in checkpoints. Measured on an
    H200 (`1b-bench`, history 16): 0.975x current scaling's speed, and a loss up to 3.5 %
    above bf16's over 200 steps (bench/RESULTS.md): an option to study, not a speed-up. A long
    history keeps a loss spike's amaxes for n steps; 1 (Megatron's default length) follows
    the tensors one step late."""
    fp8_amax_margin: int = 0
    """With ``train.fp8_amax_history`` n > 0: the delayed scales leave 2^margin of headroom
    above the history's amax (Transformer Engine's ``margin``), so a tensor that grows up to
    2^margin x from one step to the next does not saturate. The log's ``fp8_overshoot_input``
    / ``fp8_overshoot_grad`` show the largest such growth of each interval (above 1: values
    saturated)."""
    fp8_amax_interval: int = 1
    """With ``train.fp8_amax_history`` n > 0: amaxes are recorded on every k-th step only
    (counted over the run, so a resume keeps the phase); the steps between scale from the
    history with no amax reduction at all, the speed of fixed scales (`1b-bench` on an H100:
    1.339x bf16 against 1.203x recording every step). A tensor that grows between recorded
    steps saturates: watch the log's ``fp8 overshoot`` and ``train.fp8_amax_margin``."""
    fp8_weight_cache: bool = False
    """With ``train.fp8`` and the tensor recipe: each layer quantises its weight once a step,
    at its first micro-batch, and the later micro-batches (and recomputed forwards) read that
    fp8 copy and its transpose (Transformer Engine's weight caching across micro-batches; two
    bytes a parameter held). Bit for bit what requantising gives; it pays when a step has
    several micro-batches: on an H100, `1b-bench` at mb 1 x 8 ran 332.4 ms a step against
    375.8 uncached (bench/RESULTS.md, 2026-12-06; before the transpose was kept too)."""
    optimizer_kernel: Literal["auto", "torch", "flat"] = "auto"
    """The AdamW update: ``torch``, torch's fused multi-tensor kernel, then each fp32 master
    shard copied into the bf16/fp16 parameters; ``flat``, one streaming kernel of the
    project's own per run of a shard's parameters (Triton on a GPU, the same torch ops
    elsewhere) that updates master and moments and writes the low-precision parameter in
    the same pass (``mega_zero_optim`` ``flat_fused``; the moments live in one flat buffer a
    shard, the checkpoint format is unchanged); not with ``parallel.optimizer_offload``.
    ``auto``: ``flat`` on CUDA without the offload, else ``torch``. On an H100 the flat
    kernel took the compiled ``1b-bench`` step from 278.1 to 272.5 ms (1.021x;
    bench/RESULTS.md, 2026-12-07, fifteenth session)."""
    optimizer_moment_dtype: Literal["fp32", "bf16"] = "fp32"
    """The dtype AdamW's two moments are stored in: ``bf16`` keeps them in the flat kernel's
    buffers rounded to nearest bf16 (each step computes in fp32), saving 4 bytes a parameter
    of optimizer state (13.4 GiB on ``deepseek-v3-3b`` on one GPU) and 8 of the kernel's 30
    bytes moved an element; DeepSeek-V3 trained with it (Megatron's
    ``--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``). ``auto`` kernel then means ``flat``
    on any device; not with ``optimizer_kernel torch`` or ``parallel.optimizer_offload``.
    Checkpoints hold the moments in this dtype and load converted into the other."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation."""
    compile: bool = False
    """torch.compile each transformer layer."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = "default"
    """torch.compile's mode for the layers: ``reduce-overhead`` replays each layer's forward and
    backward as CUDA graphs (GPU, dense models, tp/cp/ep 1; see ``mega_pretrain.graphs``)."""
    loss_chunk_size: int = 0
    """Tokens per chunk of the fused output layer + cross-entropy, which never holds the
    ``[tokens, vocab/tp]`` logits (peak about chunk x vocab/tp fp32 values; backward
    recomputes each chunk's logits: one more GEMM of the head's size); any tp, SP, tied
    embeddings and MTP. 0: the output layer, then the loss, the logits materialised."""
    log_interval: int = 10
    """Steps between log lines (where the loss is read on the host; bench/NOTES.md lists the
    other per-step host reads)."""
    timing_sync: bool = False
    """Synchronize the GPU at the end of each phase of a step (data, forward-backward,
    optimizer, checkpoint), so that the logged time breakdown (``data_ms``, ``fwd_bwd_ms``,
    ...) is exact; off, the phases are timed on the host clock and their split is
    approximate under asynchronous CUDA (the interval's total is exact either way)."""
    eval_interval: int = 100
    """Steps between evaluations on the validation split (0 disables)."""
    eval_steps: int = 4
    """Micro-batches per dp rank in one evaluation."""
    exit_interval: int = 0
    """Save and exit once the step is a multiple of this (time-sliced cluster jobs); 0: never."""
    nan_policy: Literal["stop", "skip"] = "stop"
    """On a NaN/inf loss or gradient: stop with the step number, or skip the step."""

    @property
    def warmup(self) -> int:
        """The warm-up steps the schedule runs: ``warmup_steps``, or its default for ``steps``."""
        return min(20, self.steps // 10) if self.warmup_steps is None else self.warmup_steps


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from."""

    paths: tuple[str, ...] = ()
    """Prefixes of preprocessed token files; empty means the embedded default corpus."""
    weights: tuple[float, ...] = ()
    """Blend weights, one per path (default: equal)."""
    tokenizer: str = "byte"
    """Tokenizer spec: byte, hf:PATH, tiktoken:PATH."""
    valid_fraction: float = 0.02
    """Share of documents held out for evaluation."""
    reset_position_ids: bool = False
    """Positions restart at 0 after each EOD of a packed sample (Megatron's flag)."""
    reset_attention_mask: bool = False
    """A token attends only to earlier tokens of its own document in a packed sample; the
    EOD belongs to the document it ends (Megatron's flag)."""
    eod_mask_loss: bool = False
    """Leave the predictions made at EOD inputs (whose targets are the next document's first
    token) out of the loss, the mean over the remaining positions (Megatron's flag)."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and resuming."""

    save_interval: int = 100
    """Steps between checkpoints (0: only at the end and on SIGTERM)."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted."""
    load: str = "auto"
    """'auto' resumes from the run folder's latest checkpoint, 'none' starts fresh, or a path."""
    async_save: bool = False
    """Write checkpoints in the background: a save copies each rank's tensors to host memory
    (pinned on a GPU) and training goes on while they are written; the folder and ``latest``
    are committed once every rank's write finished, a second save waits for the first, and
    the run's end and a SIGTERM wait for it. Costs one host copy of each rank's state."""


@dataclass(frozen=True)
class RunConfig:
    """The run folder and reporting."""

    name: str = "tiny"
    """Run name: the folder is ``<out_dir>/<name>``."""
    out_dir: str = "runs"
    """Parent folder of run folders."""
    tensorboard: bool = True
    """Write TensorBoard events."""
    wandb: bool = False
    """Also log to Weights & Biases: rank 0 logs the scalars the JSONL and TensorBoard sinks
    get, and the resolved config once; a resumed run continues its W&B run (the id is kept
    in the run folder). Needs the extra: ``pip install 'mega-pretrain[wandb]'``."""
    wandb_project: str = "mega-pretrain"
    """W&B project."""
    wandb_entity: str | None = None
    """W&B entity (team or user); unset: your W&B default."""
    wandb_name: str | None = None
    """W&B run name; unset: ``run.name``."""
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """W&B mode: online, offline (the run is kept under the run folder's ``wandb/``, for
    ``wandb sync``) or disabled; auto: ``$WANDB_MODE``, else online."""
    peak_tflops: float | None = None
    """Peak TFLOP/s per device for MFU (default: from the detected GPU)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train."""
    memory_gib: float | None = None
    """Memory per device for ``train.micro_batch_size = 0`` (auto); default: the GPU's."""
    timeout_minutes: float = 10.0
    """Timeout of every process group and collective: a rank waiting longer than this for a
    peer (a dead or hung rank) fails with an error instead of hanging."""


@dataclass(frozen=True)
class TrainerConfig:
    """Everything ``mega-pretrain train`` needs."""

    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if errors else f"{where} cannot be None")
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ValueError(f"{where} ({value!r}) must be one of {choices}")
        return value
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(_convert(v, args[0], where) for v in items if v != "")
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a table, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{where} ({value!r}) must be true or false")
    if tp is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"{where} ({value!r}) must be an integer")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where} ({value!r}) must be an integer") from None
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where} ({value!r}) must be a number") from None
    if tp is str:
        return str(value)
    raise ValueError(f"{where} has an unsupported type {tp!r}")  # pragma: no cover


def _build(cls: type[Any], values: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        where = f"{prefix}{key}"
        if key not in known:
            raise ValueError(
                f"unknown setting {where!r}; known settings in {prefix.rstrip('.') or 'the root'}: "
                f"{', '.join(known)}"
            )
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ValueError(f"{where} must be a table of settings, got {value!r}")
            kwargs[key] = _build(typing.cast(type[Any], tp), value, f"{where}.")
        else:
            kwargs[key] = _convert(value, tp, where)
    return cls(**kwargs)


_SHORTCUTS = {"tp", "pp", "cp", "ep", "etp", "vpp"}


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if len(parts) == 1 and parts[0] in _SHORTCUTS:
        parts = ["parallel", parts[0]]
    if parts[0] == "model" and len(parts) == 2 and parts[1] != "size":
        parts = ["model", "overrides", parts[1]]
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted!r} goes below a setting that is not a table")
    node[parts[-1]] = value


def load_config(
    path: str | Path | None = None, overrides: list[tuple[str, str]] | None = None
) -> TrainerConfig:
    """The config from an optional TOML file, then ``(dotted.name, value)`` overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} does not exist")
        try:
            tree = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
        if "model" in tree and isinstance(tree["model"], dict):
            model = dict(tree["model"])
            extra = {k: model.pop(k) for k in list(model) if k not in ("size", "overrides")}
            model.setdefault("overrides", {}).update(extra)
            tree["model"] = model
    for key, value in overrides or []:
        _set_dotted(tree, key, _parse_scalar(value))
    config = _build(TrainerConfig, tree, "")
    assert isinstance(config, TrainerConfig)
    return config


def _parse_scalar(text: str) -> Any:
    """An override's value as TOML would read it (numbers, booleans), else the string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def config_to_dict(config: Any) -> dict[str, Any]:
    """A plain dict of the config (for JSON/TOML dumps and checkpoints)."""
    return dataclasses.asdict(config)
