"""Column- and row-parallel linear layers (Megatron's tensor parallelism for one GEMM).

``ColumnParallelLinear`` splits the weight's output rows: each rank computes
``[s, b, out/tp]``. ``RowParallelLinear`` splits the input columns: each rank computes a
partial ``[s, b, out]`` that one all-reduce (or, under sequence parallel, one
reduce-scatter to ``[s/tp, b, out]``) completes. Column -> Row therefore costs one
collective per block forward. Under sequence parallel the column layer all-gathers the
sequence (``[s/tp, b, h] -> [s, b, h]``) before its GEMM.

In the column layer's backward the input-gradient all-reduce (or reduce-scatter) is
issued asynchronously and overlapped with the weight-gradient GEMM.

With ``fp8=Fp8Recipe()`` the forward, dgrad and wgrad GEMMs run in FP8 (``mega_tp_layers.fp8``);
the collectives keep the activations' dtype. Scales are those of the whole tensors, not
of each rank's shard: a sharded operand (the weight shard; the column layer's output
gradient, the row layer's input) takes its amax all-reduced (max) over tp, so the fp8
values are the same at any tp; operands every rank holds whole are scaled locally.

With ``tp_comm_overlap=True`` (sequence parallel, tp > 1) the sequence all-gather and
reduce-scatter run as rings of chunks overlapped with the GEMMs (``mega_tp_layers.overlap``).

Inside :func:`~mega_tp_layers.defer_weight_grads` (zero-bubble pipelines) the backward
computes the input gradient only and leaves the weight GEMM (fp8 too, sequence parallel
too: see ``mega_tp_layers.column_parallel``) to the store's W pass; only the
``tp_comm_overlap`` rings keep their backward fused.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from mega_tp_layers._comm import (
    check_divisible_dim0,
    check_group,
    group_rank,
    group_size,
)
from mega_tp_layers.column_parallel import column_parallel_linear
from mega_tp_layers.fp8 import (
    FP8_ALIGNMENT,
    Fp8Recipe,
    Fp8Shard,
    fp8_linear,
)
from mega_tp_layers.fp8_delayed import (
    amax_history_for,
    delayed_for,
)
from mega_tp_layers.fp8_scaling import check_fp8_layout
from mega_tp_layers.fp8_weight_cache import cached_fp8_weight, weight_cache_for
from mega_tp_layers.init import InitMethod, Normal, PaddedRows, Zeros
from mega_tp_layers.main_grad_fusion import (
    WGRAD_FUSION_ATTR,
    fused_wgrad_key,
    register_wgrad_target,
)
from mega_tp_layers.mappings import (
    gather_from_tp_region,
    reduce_from_tp_region_inplace,
    reduce_scatter_to_sequence_region,
    scatter_to_tp_region,
)
from mega_tp_layers.overlap import (
    check_tp_comm_overlap,
    linear_reduce_scatter,
)
from mega_tp_layers.params import ShardedModule, creation_generator
from mega_tp_layers.shard import ShardSpec
from mega_tp_layers.te_backend import Backend, check_backend, te_linear
from mega_tp_layers.vocab import padded_vocab_size
from mega_tp_layers.wgrad import current_weight_grad_store, linear_with_wgrad

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "column_parallel_linear"]


def _check_features(owner: str, in_features: int, out_features: int) -> None:
    for label, value in (("in_features", in_features), ("out_features", out_features)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner} {label} ({value!r}) must be a positive integer")


def _check_fp8(
    owner: str, fp8: object, backend: str, dims: tuple[tuple[str, int], ...]
) -> Fp8Recipe | None:
    """``fp8`` is None or a recipe for the torch backend, and the shard's GEMM dims qualify."""
    if fp8 is None:
        return None
    if not isinstance(fp8, Fp8Recipe):
        raise ValueError(f"{owner} fp8 ({fp8!r}) must be an Fp8Recipe or None")
    if backend != "torch":
        raise ValueError(
            f"{owner} fp8=Fp8Recipe(...) swaps the torch backend's GEMMs, not backend "
            f"{backend!r}; use backend='torch', or fp8_autocast with the te backend"
        )
    bad = [f"{label} ({value})" for label, value in dims if value % FP8_ALIGNMENT]
    if bad:
        raise ValueError(
            f"{owner} with fp8 needs {' and '.join(bad)} to be multiples of {FP8_ALIGNMENT} "
            "for torch._scaled_mm; choose sizes that are, or leave fp8 off for this layer"
        )
    return fp8


def _check_overlap(owner: str, overlap: bool, sp: bool, tp: int, backend: str) -> bool:
    """``tp_comm_overlap`` applies: sequence parallel over tp > 1 ranks, torch backend."""
    if overlap and backend != "torch":
        raise ValueError(
            f"{owner} tp_comm_overlap=True overlaps the torch backend's GEMMs, not backend "
            f"{backend!r}; use backend='torch', or Transformer Engine's own overlap"
        )
    return check_tp_comm_overlap(owner, overlap, sp, tp)


def _check_input(owner: str, x: Tensor, expected: int, what: str, sp: bool, tp: int) -> None:
    if x.dim() < (2 if sp else 1) or x.shape[-1] != expected:
        layout = "sequence-first [s, b, ...]" if sp else "[..., features]"
        raise ValueError(
            f"{owner} expects a {layout} input whose last dimension is {what} ({expected}), "
            f"got shape {tuple(x.shape)}; pass the activation this layer is built for"
        )
    if sp:
        check_divisible_dim0(x, tp, owner)


def _wgrad_target(layer: ColumnParallelLinear | RowParallelLinear, wanted: bool) -> Tensor | None:
    """Mark ``layer.weight`` for ``mega_tp_layers.main_grad_fusion`` where asked and every
    path of its forward fuses (the torch backend's bf16 GEMMs: not fp8, not the rings); its
    key, or None."""
    if not wanted or layer.backend != "torch" or layer.fp8 is not None or layer.tp_comm_overlap:
        return None
    setattr(layer.weight, WGRAD_FUSION_ATTR, True)
    return register_wgrad_target(layer, "weight")


class ColumnParallelLinear(ShardedModule):
    """``y = x A^T + b`` with ``A`` (and ``b``) split by output rows over ``tp_group``.

    Input ``[s, b, in]`` (``[s/tp, b, in]`` with ``sequence_parallel``, gathered before the
    GEMM); output ``[s, b, out/tp]``, or ``[s, b, out]`` with ``gather_output``. With
    ``skip_bias_add`` the bias is not added: read it from ``.bias`` and fuse it into what
    follows. ``pad_out_features`` rounds ``out_features`` up to a multiple of tp with zero
    rows, for a vocabulary head (see :func:`~mega_tp_layers.padded_vocab_size`).
    Weights are drawn whole and sliced (``seed``/``name``: see ``mega_tp_layers.init``).
    ``backend="te"`` runs the GEMM in Transformer Engine (unverified; its parameters then
    live in ``.te_module``). ``wgrad_fusion=True``: under a data-parallel wrapper that offers
    it (mega-zero-optim's, fp32 gradients) the weight gradient is added straight into
    ``weight.main_grad`` (:mod:`mega_tp_layers.main_grad_fusion`; bf16 GEMMs of the torch
    backend only). Only for a weight that no code outside this layer's forward uses.
    """

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group: ProcessGroup,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        skip_bias_add: bool = False,
        pad_out_features: bool = False,
        init_method: InitMethod | None = None,
        seed: int | None = None,
        name: str = "",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        group_name: str = "tp",
        backend: Backend = "torch",
        fp8: Fp8Recipe | None = None,
        tp_comm_overlap: bool = False,
        wgrad_fusion: bool = False,
    ) -> None:
        super().__init__()
        owner = "ColumnParallelLinear"
        self._wgrad_key: Tensor | None = None
        self.tp_group = check_group(tp_group, owner)
        _check_features(owner, in_features, out_features)
        if backend == "te" and skip_bias_add:
            raise ValueError(
                f"{owner} skip_bias_add=True is not supported with backend='te' (Transformer "
                "Engine keeps the bias inside its module, so .bias would not exist); use "
                "backend='torch', or let the layer add its bias"
            )
        self.backend = check_backend(backend)
        tp, rank = group_size(tp_group), group_rank(tp_group)
        full_out = padded_vocab_size(out_features, tp) if pad_out_features else out_features
        if full_out % tp != 0:
            raise ValueError(
                f"out_features ({out_features}) is not divisible by tp ({tp}); choose a "
                f"multiple of {tp}, or pad_out_features=True for a vocabulary head"
            )
        if skip_bias_add and gather_output:
            raise ValueError(
                "skip_bias_add=True with gather_output=True would return a gathered output "
                "next to a sharded bias; add the bias in the layer or keep the output sharded"
            )
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        self.out_features_per_rank = full_out // tp
        self.fp8 = _check_fp8(
            owner, fp8, self.backend,
            (("in_features", in_features), ("out_features/tp", self.out_features_per_rank)),
        )  # fmt: skip
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.tp_comm_overlap = _check_overlap(
            owner, tp_comm_overlap, sequence_parallel, tp, backend
        )
        shard = ("out_features/tp", self.out_features_per_rank)
        check_fp8_layout(owner, self.fp8, tp, shard, self.tp_comm_overlap)
        self.fp8_amax = amax_history_for(self.fp8, device)
        self.fp8_weight = weight_cache_for(
            self.fp8, (self.out_features_per_rank, in_features), device
        )
        self.skip_bias_add = skip_bias_add
        w_init: InitMethod = init_method if init_method is not None else Normal(0.02)
        if full_out != out_features:
            w_init = PaddedRows(w_init, out_features)
        w_spec = ShardSpec(0, tp, rank, group_name, (full_out, in_features), False)
        b_spec = ShardSpec(0, tp, rank, group_name, (full_out,), False)
        gen_w = creation_generator(seed, name, "weight")
        gen_b = creation_generator(seed, name, "bias")
        if self.backend == "te":
            self.te_module = te_linear(
                in_features, full_out, parallel_mode="column", tp_group=tp_group, tp_size=tp,
                sequence_parallel=sequence_parallel, bias=bias, return_bias=skip_bias_add,
                dtype=dtype, device=device,
            )  # fmt: skip
            self._adopt_param("te_module.weight", w_spec, w_init, generator=gen_w)
            if bias:
                self._adopt_param("te_module.bias", b_spec, Zeros(), generator=gen_b)
            return
        self._make_param("weight", w_spec, w_init, generator=gen_w, dtype=dtype, device=device)
        if bias:
            self._make_param("bias", b_spec, Zeros(), generator=gen_b, dtype=dtype, device=device)
        else:
            self.register_parameter("bias", None)
        self._wgrad_key = _wgrad_target(self, wgrad_fusion)

    def forward(self, x: Tensor) -> Tensor:
        """``[s, b, in]`` (``[s/tp, b, in]`` under SP) -> ``[s, b, out/tp]`` (or gathered)."""
        sp = self.sequence_parallel
        _check_input("ColumnParallelLinear", x, self.in_features, "in_features", sp, 1)
        if self.backend == "te":
            out = self.te_module(x)
            out = out[0] if self.skip_bias_add else out
            if self.gather_output:
                out = gather_from_tp_region(out, self.tp_group)
            result: Tensor = out
            return result
        bias = None if self.skip_bias_add else self.bias
        out = column_parallel_linear(
            x, self.weight, bias, tp_group=self.tp_group,
            sequence_parallel=sp, gather_output=self.gather_output, fp8=self.fp8,
            tp_comm_overlap=self.tp_comm_overlap, fp8_delayed=delayed_for(self.fp8_amax, x),
            fp8_weight=cached_fp8_weight(self.fp8_weight, self.weight, self.fp8, self.tp_group),
            wgrad_key=fused_wgrad_key(self.weight, self._wgrad_key),
        )  # fmt: skip
        if self.gather_output and out.shape[-1] != self.out_features:
            out = out[..., : self.out_features]  # padded rows' outputs are not the layer's
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp}, "
            f"out_per_rank={self.out_features_per_rank}, sequence_parallel="
            f"{self.sequence_parallel}, gather_output={self.gather_output}, backend={self.backend}"
            f"{', fp8=True' if self.fp8 is not None else ''}"
            f"{', tp_comm_overlap=True' if self.tp_comm_overlap else ''}"
        )


class RowParallelLinear(ShardedModule):
    """``y = x A^T + b`` with ``A`` split by input columns over ``tp_group``.

    Input ``[s, b, in/tp]`` (``input_is_parallel=True``, e.g. a column layer's output) or
    ``[s, b, in]`` (split here); the partial products are all-reduced into ``[s, b, out]``,
    or reduce-scattered into ``[s/tp, b, out]`` with ``sequence_parallel``. The bias is
    replicated and added once, after the reduction (or not at all with
    ``skip_bias_add``: read it from ``.bias``). Under sequence parallel its gradient is
    partial per rank: call :func:`~mega_tp_layers.sync_sequence_parallel_grads`.
    ``wgrad_fusion``: as :class:`ColumnParallelLinear`'s.
    """

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group: ProcessGroup,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        skip_bias_add: bool = False,
        init_method: InitMethod | None = None,
        seed: int | None = None,
        name: str = "",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        group_name: str = "tp",
        backend: Backend = "torch",
        fp8: Fp8Recipe | None = None,
        tp_comm_overlap: bool = False,
        wgrad_fusion: bool = False,
    ) -> None:
        super().__init__()
        owner = "RowParallelLinear"
        self._wgrad_key: Tensor | None = None
        self.tp_group = check_group(tp_group, owner)
        _check_features(owner, in_features, out_features)
        if backend == "te" and skip_bias_add:
            raise ValueError(
                f"{owner} skip_bias_add=True is not supported with backend='te' (Transformer "
                "Engine keeps the bias inside its module, so .bias would not exist); use "
                "backend='torch', or let the layer add its bias"
            )
        self.backend = check_backend(backend)
        tp, rank = group_size(tp_group), group_rank(tp_group)
        if in_features % tp != 0:
            raise ValueError(
                f"in_features ({in_features}) is not divisible by tp ({tp}); "
                f"choose a multiple of {tp}"
            )
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "sequence_parallel=True needs input_is_parallel=True (a tp-sharded input); "
                "feed the output of a ColumnParallelLinear"
            )
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        self.in_features_per_rank = in_features // tp
        self.fp8 = _check_fp8(
            owner, fp8, self.backend,
            (("in_features/tp", self.in_features_per_rank), ("out_features", out_features)),
        )  # fmt: skip
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.tp_comm_overlap = _check_overlap(
            owner, tp_comm_overlap, sequence_parallel, tp, backend
        )
        shard = ("in_features/tp", self.in_features_per_rank)
        check_fp8_layout(owner, self.fp8, tp, shard, self.tp_comm_overlap)
        self.fp8_amax = amax_history_for(self.fp8, device)
        self.fp8_weight = weight_cache_for(
            self.fp8, (out_features, self.in_features_per_rank), device
        )
        self.skip_bias_add = skip_bias_add
        w_init: InitMethod = init_method if init_method is not None else Normal(0.02)
        w_spec = ShardSpec(1, tp, rank, group_name, (out_features, in_features), False)
        b_spec = ShardSpec(None, tp, rank, group_name, (out_features,), rank != 0)
        gen_w = creation_generator(seed, name, "weight")
        gen_b = creation_generator(seed, name, "bias")
        if self.backend == "te":
            self.te_module = te_linear(
                in_features, out_features, parallel_mode="row", tp_group=tp_group, tp_size=tp,
                sequence_parallel=sequence_parallel, bias=bias, return_bias=skip_bias_add,
                dtype=dtype, device=device,
            )  # fmt: skip
            self._adopt_param("te_module.weight", w_spec, w_init, generator=gen_w)
            if bias:
                self._adopt_param(
                    "te_module.bias", b_spec, Zeros(), generator=gen_b,
                    sequence_parallel=sequence_parallel,
                )  # fmt: skip
            return
        self._make_param("weight", w_spec, w_init, generator=gen_w, dtype=dtype, device=device)
        if bias:
            self._make_param(
                "bias", b_spec, Zeros(), generator=gen_b, dtype=dtype, device=device,
                sequence_parallel=sequence_parallel,
            )  # fmt: skip
        else:
            self.register_parameter("bias", None)
        self._wgrad_key = _wgrad_target(self, wgrad_fusion)

    def forward(self, x: Tensor) -> Tensor:
        """``[s, b, in/tp]`` -> ``[s, b, out]`` (``[s/tp, b, out]`` under SP)."""
        owner, tp, group = "RowParallelLinear", self.tp, self.tp_group
        if not self.input_is_parallel:
            _check_input(owner, x, self.in_features, "in_features", False, 1)
            x = scatter_to_tp_region(x, group)  # [s, b, in] -> [s, b, in/tp]
        sp = self.sequence_parallel
        _check_input(owner, x, self.in_features_per_rank, "in_features/tp", sp, tp)
        if self.backend == "te":
            out = self.te_module(x)
            result: Tensor = out[0] if self.skip_bias_add else out
            return result
        bias = None if self.skip_bias_add else self.bias
        fp8 = self.fp8
        # an input without a gradient has no B for W to follow: the backward stays fused
        store = current_weight_grad_store() if x.requires_grad else None
        delayed = delayed_for(self.fp8_amax, x)
        w8 = cached_fp8_weight(self.fp8_weight, self.weight, fp8, group)  # a weight cache's
        key = fused_wgrad_key(self.weight, self._wgrad_key)  # the weight gradient into main_grad
        if tp == 1:
            if fp8 is not None:
                return fp8_linear(
                    x, self.weight, bias, recipe=fp8, store=store, delayed=delayed, weight_q=w8
                )
            return linear_with_wgrad(x, self.weight, bias, store, key)
        if self.tp_comm_overlap:  # [s, b, in/tp] -> [s/tp, b, out], ring overlapped
            out = linear_reduce_scatter(x, self.weight, tp_group=group, fp8=fp8)
            return out if bias is None else out + bias
        # [s, b, in/tp] -> [s, b, out], partial over tp
        if fp8 is None:
            partial = linear_with_wgrad(x, self.weight, None, store, key)
        else:  # the input and weight are shards over tp (along in): scaled as the wholes
            shard = Fp8Shard(group, 1)
            partial = fp8_linear(
                x, self.weight, recipe=fp8, x_group=shard, w_group=shard, store=store,
                delayed=delayed, weight_q=w8,
            )  # fmt: skip
        if sp:
            out = reduce_scatter_to_sequence_region(partial, group)  # -> [s/tp, b, out]
        else:
            out = reduce_from_tp_region_inplace(partial, group)  # -> [s, b, out]
        return out if bias is None else out + bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp}, "
            f"in_per_rank={self.in_features_per_rank}, sequence_parallel="
            f"{self.sequence_parallel}, input_is_parallel={self.input_is_parallel}, "
            f"backend={self.backend}{', fp8=True' if self.fp8 is not None else ''}"
            f"{', tp_comm_overlap=True' if self.tp_comm_overlap else ''}"
        )
