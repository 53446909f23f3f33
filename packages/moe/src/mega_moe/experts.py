"""The routed experts of one rank: ``SequentialMLP`` (a loop) and ``GroupedMLP`` (grouped GEMMs).

Both take the tokens of their local experts in expert-major order, ``[M, h]`` with
``counts[l]`` rows for local expert l, and return ``[M, h]``. With expert tensor
parallelism each rank holds an etp slice of every expert's intermediate dimension, and its
output is a partial sum over etp (the dispatcher reduce-scatters it).

Weights per expert, in the nn.Linear layout: ``weight1 [G, ffn, h]`` with ``G = 2`` for
SwiGLU (gate, then up) or 1 for GeLU, and ``weight2 [h, ffn]``; etp splits ``ffn``.
Initialisation does not depend on ep or etp (DESIGN rule 2): GroupedMLP draws the full
``[E, G, ffn, h]`` tensor and keeps its slice; SequentialMLP draws each expert from a
generator named after its global index (``local_experts.<e>.weight1``), or, without a
seed, draws every expert in order from the default generator and keeps its own.

Inside :func:`mega_tp_layers.defer_weight_grads` (zero-bubble pipelines) both leave their
weight gradients to the store's W pass: the grouped GEMMs through
:func:`mega_moe._gemm.split_grouped_linear`, the loop's GEMMs through
:func:`mega_tp_layers.split_linear`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mega_moe._comm import Group, check_group, group_rank, group_size
from mega_moe._fp8_grouped import fp8_grouped_linear, fp8_grouped_mm_supported, fp8_layout
from mega_moe._gemm import (
    expert_activation,
    grouped_linear,
    grouped_mm_available,
    split_grouped_linear,
)
from mega_moe._main_grad_gemm import main_grad_grouped_linear
from mega_moe.config import Activation, GroupedGemm
from mega_moe.expert_shard import EXPERT_ATTR, ExpertShard
from mega_moe.fp8_expert_weights import Fp8ExpertWeights
from mega_moe.wgrad_accum import (
    MAIN_GRAD_ALPHA_ATTR,
    WGRAD_FUSION_ATTR,
    register_wgrad_target,
)
from mega_tp_layers import (
    InitMethod,
    Normal,
    ShardedModule,
    ShardSpec,
    creation_generator,
    current_weight_grad_store,
    init_full,
    split_linear,
)

__all__ = ["GroupedMLP", "SequentialMLP"]


@dataclass(frozen=True)
class EtpSlice:
    """Init method of a stacked expert weight: draw the full tensor, keep one etp slice.

    ``full`` is the ``[E, ...]`` tensor the ep group holds (cut along ``dim`` by etp);
    the whole ``[E, ...]`` tensor is drawn with ``inner`` and slice ``rank`` copied in.
    """

    inner: InitMethod
    dim: int
    etp: int
    rank: int

    def __call__(self, full: Tensor, generator: torch.Generator) -> None:
        shape = list(full.shape)
        shape[self.dim] *= self.etp
        whole = init_full(tuple(shape), self.inner, generator)
        full.copy_(whole.chunk(self.etp, dim=self.dim)[self.rank])


@dataclass(frozen=True)
class _Layout:
    """Sizes and ranks shared by both expert implementations (checked once)."""

    hidden: int
    ffn: int
    experts: int
    gated: bool
    ep: int
    ep_rank: int
    etp: int
    etp_rank: int

    @property
    def local(self) -> int:
        return self.experts // self.ep

    @property
    def ffn_local(self) -> int:
        return self.ffn // self.etp

    @property
    def g(self) -> int:
        return 2 if self.gated else 1

    def shard(self, first: int, num: int, stacked: bool, shape: tuple[int, ...]) -> ExpertShard:
        """Metadata of ``num`` experts from ``first``; etp splits dim 1 (ffn) of ``shape``."""
        return ExpertShard(
            num_experts=self.experts, first_expert=first, num_local=num, stacked=stacked,
            expert_shape=shape, etp_dim=1, ep=self.ep, ep_rank=self.ep_rank, etp=self.etp,
            etp_rank=self.etp_rank,
        )  # fmt: skip


def _layout(
    owner: str, hidden: int, ffn: int, experts: int, activation: str, ep: Group, etp: Group
) -> _Layout:
    for label, value in (
        ("hidden_size", hidden),
        ("ffn_hidden_size", ffn),
        ("num_experts", experts),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner} {label} ({value!r}) must be a positive integer")
    if activation not in ("swiglu", "gelu"):
        raise ValueError(f"{owner} activation ({activation!r}) must be 'swiglu' or 'gelu'")
    ep = check_group(ep, "ep_group", owner)
    etp = check_group(etp, "etp_group", owner)
    ep_size, etp_size = group_size(ep), group_size(etp)
    if experts % ep_size:
        raise ValueError(
            f"num_experts ({experts}) is not divisible by ep ({ep_size}); "
            f"choose a multiple of {ep_size} experts or a smaller ep"
        )
    if ffn % etp_size:
        raise ValueError(
            f"ffn_hidden_size ({ffn}) is not divisible by etp ({etp_size}); "
            f"choose a multiple of {etp_size} or a smaller etp"
        )
    return _Layout(
        hidden=hidden, ffn=ffn, experts=experts, gated=activation == "swiglu", ep=ep_size,
        ep_rank=group_rank(ep), etp=etp_size, etp_rank=group_rank(etp),
    )  # fmt: skip


def _mark_expert(module: ShardedModule, path: str, shard: ExpertShard) -> None:
    """Attach ``mega_expert`` to a parameter (``KeepsParamAttrs`` keeps it through ``to_empty``)."""
    setattr(module.get_parameter(path), EXPERT_ATTR, shard)


def _check_tokens(owner: str, x: Tensor, counts: list[int] | Tensor, layout: _Layout) -> None:
    if x.dim() != 2 or x.shape[1] != layout.hidden:
        raise ValueError(
            f"{owner} expects tokens [M, {layout.hidden}], got shape {tuple(x.shape)}; "
            "pass the dispatcher's expert-major tokens"
        )
    if isinstance(counts, Tensor):  # device counts: their sum is not read (no host sync)
        if counts.shape != (layout.local,):
            raise ValueError(
                f"{owner} got counts of shape {tuple(counts.shape)} for {layout.local} local "
                "experts; pass one count per local expert"
            )
        return
    if len(counts) != layout.local or sum(counts) != x.shape[0]:
        raise ValueError(
            f"{owner} got counts {counts} for {x.shape[0]} tokens and {layout.local} local "
            "experts; pass one count per local expert that sum to the number of tokens"
        )


class _Expert(ShardedModule):
    """One expert's etp slice: ``weight1 [G, ffn/etp, h]``, ``weight2 [h, ffn/etp]``."""

    weight1: nn.Parameter
    weight2: nn.Parameter

    def __init__(
        self,
        layout: _Layout,
        index: int,
        inits: tuple[InitMethod, InitMethod],
        generators: tuple[torch.Generator, torch.Generator],
        dtype: torch.dtype | None,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        lay, n, r = layout, layout.etp, layout.etp_rank
        shapes = ((lay.g, lay.ffn, lay.hidden), (lay.hidden, lay.ffn))
        for name, shape, init, gen in zip(
            ("weight1", "weight2"), shapes, inits, generators, strict=True
        ):
            spec = ShardSpec(1, n, r, "etp", shape, False)
            self._make_param(name, spec, init, generator=gen, dtype=dtype, device=device)
            _mark_expert(self, name, lay.shard(index, 1, False, shape))
        self.gated = lay.gated

    def forward(self, x: Tensor) -> Tensor:
        """``[m, h] -> [m, h]`` (partial over etp)."""
        store = current_weight_grad_store() if self.weight1.requires_grad else None
        w1 = self.weight1.flatten(0, 1)  # [G*ffn/etp, h]
        if store is None:
            h = nn.functional.linear(x, w1)  # [m, G*ffn/etp]
            return nn.functional.linear(expert_activation(h, self.gated), self.weight2)
        h = split_linear(x, w1, None, store)
        return split_linear(expert_activation(h, self.gated), self.weight2, None, store)


class SequentialMLP(nn.Module):
    """The local experts as separate modules, run one after another (the reference path).

    ``local_experts`` is keyed by global expert index, so parameter names (and seeded
    initialisation) do not depend on ep: ``local_experts.5.weight1`` is expert 5 anywhere.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        *,
        ep_group: Group = None,
        etp_group: Group = None,
        activation: Activation = "swiglu",
        init_method: InitMethod | None = None,
        output_init_method: InitMethod | None = None,
        seed: int | None = None,
        name: str = "",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        lay = _layout(
            "SequentialMLP",
            hidden_size,
            ffn_hidden_size,
            num_experts,
            activation,
            ep_group,
            etp_group,
        )
        self.layout = lay
        init1: InitMethod = init_method if init_method is not None else Normal(0.02)
        init2: InitMethod = output_init_method if output_init_method is not None else init1
        first = lay.ep_rank * lay.local
        mine = range(first, first + lay.local)
        meta = torch.device(device).type == "meta" if device is not None else False
        experts: dict[str, _Expert] = {}
        for e in range(num_experts):
            prefix = f"{name}.local_experts.{e}" if name else f"local_experts.{e}"
            if e in mine:
                gens = (
                    creation_generator(seed, prefix, "weight1"),
                    creation_generator(seed, prefix, "weight2"),
                )
                experts[str(e)] = _Expert(lay, e, (init1, init2), gens, dtype, device)
            elif seed is None and not meta:  # keep the default generator in step
                init_full((lay.g, lay.ffn, lay.hidden), init1, torch.default_generator)
                init_full((lay.hidden, lay.ffn), init2, torch.default_generator)
        self.local_experts = nn.ModuleDict(experts)

    def forward(self, x: Tensor, counts: list[int] | Tensor) -> Tensor:
        """``[M, h]`` expert-major (``counts[l]`` rows for local expert l) -> ``[M, h]``."""
        _check_tokens("SequentialMLP", x, counts, self.layout)
        sizes = counts.tolist() if isinstance(counts, Tensor) else counts
        blocks = torch.split(x, sizes)
        outs = [
            expert(block) for expert, block in zip(self.local_experts.values(), blocks, strict=True)
        ]
        return torch.cat(outs)


class GroupedMLP(ShardedModule):
    """The local experts as two stacked weights and two grouped GEMMs.

    ``weight1 [E/ep, G, ffn/etp, h]`` and ``weight2 [E/ep, h, ffn/etp]``. ``gemm``:
    ``"auto"`` uses ``torch._grouped_mm`` where it runs (see :mod:`mega_moe._gemm`) and a
    loop of GEMMs elsewhere; ``"grouped_mm"`` insists on it; ``"loop"`` never uses it.

    ``fp8``: the forward and input-gradient GEMMs in FP8 (e4m3, one scale per token row and
    per expert weight row; :mod:`mega_moe._fp8_grouped`), each weight quantised once a step
    into an :class:`~mega_moe.fp8_expert_weights.Fp8ExpertWeights`; the weight gradients
    stay in the activations' dtype. On CUDA it needs sm90+ and bf16 activations; elsewhere
    the same fp8 values are multiplied in fp32.
    """

    weight1: nn.Parameter
    weight2: nn.Parameter

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        *,
        ep_group: Group = None,
        etp_group: Group = None,
        activation: Activation = "swiglu",
        gemm: GroupedGemm = "auto",
        fp8: bool = False,
        init_method: InitMethod | None = None,
        output_init_method: InitMethod | None = None,
        seed: int | None = None,
        name: str = "",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        lay = _layout(
            "GroupedMLP", hidden_size, ffn_hidden_size, num_experts, activation, ep_group, etp_group
        )
        self._etp_group = etp_group
        if gemm not in ("auto", "grouped_mm", "loop"):
            raise ValueError(f"GroupedMLP gemm ({gemm!r}) must be 'auto', 'grouped_mm' or 'loop'")
        self.layout, self.gemm = lay, gemm
        init1: InitMethod = init_method if init_method is not None else Normal(0.02)
        init2: InitMethod = output_init_method if output_init_method is not None else init1
        e, g, f, fl, h = lay.experts, lay.g, lay.ffn, lay.ffn_local, lay.hidden
        first = lay.ep_rank * lay.local
        for pname, group_shape, expert_shape, etp_dim, init in (
            ("weight1", (e, g, fl, h), (g, f, h), 2, init1),
            ("weight2", (e, h, fl), (h, f), 2, init2),
        ):
            spec = ShardSpec(0, lay.ep, lay.ep_rank, "ep", group_shape, False)
            self._make_param(
                pname,
                spec,
                EtpSlice(init, etp_dim, lay.etp, lay.etp_rank),
                generator=creation_generator(seed, name, pname),
                dtype=dtype,
                device=device,
            )
            _mark_expert(self, pname, lay.shard(first, lay.local, True, expert_shape))
            # its weight gradient can go straight into a wrapper's main_grad
            setattr(getattr(self, pname), WGRAD_FUSION_ATTR, True)
        self._wgrad_keys = (
            register_wgrad_target(self, "weight1"),
            register_wgrad_target(self, "weight2"),
        )
        self.fp8_weight1: Fp8ExpertWeights | None = None
        self.fp8_weight2: Fp8ExpertWeights | None = None
        if fp8:  # fc1's N (the intermediate) and fc2's K are the etp shards
            self.fp8_weight1 = Fp8ExpertWeights((lay.local, g * fl, h), device, None, etp_group)
            self.fp8_weight2 = Fp8ExpertWeights((lay.local, h, fl), device, etp_group, None)

    def uses_grouped_mm(self, x: Tensor) -> bool:
        """Whether a forward on tokens like ``x`` runs ``torch._grouped_mm``."""
        if self.gemm == "loop":
            return False
        w1 = self.weight1.flatten(1, 2)
        available = grouped_mm_available(x, w1, self.weight2)
        if self.gemm == "grouped_mm" and not available and x.shape[0] > 0:
            raise RuntimeError(
                f"GroupedMLP(gemm='grouped_mm') cannot run torch._grouped_mm on {x.dtype} "
                f"{x.device.type} tensors in torch {torch.__version__}; use gemm='auto'"
            )
        return available

    def forward(self, x: Tensor, counts: list[int] | Tensor, aligned: bool = False) -> Tensor:
        """``[M, h]`` expert-major (``counts[l]`` rows for local expert l) -> ``[M, h]``;
        ``counts`` on the host or ``[L]`` on the device. ``aligned``: every count is a
        multiple of 16 (the dispatcher's layout for fp8; the fp8 GEMMs then pad nothing)."""
        _check_tokens("GroupedMLP", x, counts, self.layout)
        fast = self.uses_grouped_mm(x)
        w1 = self.weight1.flatten(1, 2)  # [L, G*ffn/etp, h]
        store = current_weight_grad_store() if self.weight1.requires_grad else None
        main1, main2 = self._main_grad_keys()
        if self.fp8_weight1 is not None and self.fp8_weight2 is not None:
            self._check_fp8(x)
            etp = self._etp_group
            mains = (main1, main2) if torch.is_grad_enabled() else (None, None)
            rows = fp8_layout(counts, x.shape[0], x.device, aligned)  # both linears' rows
            h = fp8_grouped_linear(
                x, w1, counts, self.fp8_weight1.quantized(w1), param=self.weight1,
                use_grouped_mm=fast, layout=rows, n_group=etp, into_main=mains[0], store=store,
            )  # fmt: skip
            a = expert_activation(h, self.layout.gated)
            return fp8_grouped_linear(
                a, self.weight2, counts, self.fp8_weight2.quantized(self.weight2),
                param=self.weight2, use_grouped_mm=fast, layout=rows, k_group=etp,
                into_main=mains[1], store=store,
            )  # fmt: skip
        if store is not None:  # the weight gradients wait for the W pass
            h = split_grouped_linear(x, w1, counts, fast, self.weight1, store, main1)
            a = expert_activation(h, self.layout.gated)
            return split_grouped_linear(a, self.weight2, counts, fast, self.weight2, store, main2)
        if main1 is not None and main2 is not None and torch.is_grad_enabled():
            h = main_grad_grouped_linear(x, w1, counts, fast, main1)
            a = expert_activation(h, self.layout.gated)
            return main_grad_grouped_linear(a, self.weight2, counts, fast, main2)
        h = grouped_linear(x, w1, counts, fast)  # [M, h] -> [M, G*ffn/etp]
        a = expert_activation(h, self.layout.gated)  # -> [M, ffn/etp]
        return grouped_linear(a, self.weight2, counts, fast)  # -> [M, h], partial over etp

    def _check_fp8(self, x: Tensor) -> None:
        if x.device.type == "cuda" and not (
            fp8_grouped_mm_supported(x.device) and x.dtype == torch.bfloat16
        ):
            raise RuntimeError(
                f"GroupedMLP(fp8=True) runs torch._scaled_grouped_mm, which needs an sm90+ GPU "
                f"and bf16 tokens (got {x.dtype} on {torch.cuda.get_device_name(x.device)}); "
                "train in bf16 on a Hopper or newer GPU, or turn expert fp8 off"
            )

    def _main_grad_keys(self) -> tuple[Tensor | None, Tensor | None]:
        """Each weight's key (:func:`~mega_moe.wgrad_accum.register_wgrad_target`) where a
        data-parallel wrapper offered to take its gradient in ``main_grad``, else None; see
        :mod:`mega_moe.wgrad_accum`."""
        keys = []
        for param, key in zip((self.weight1, self.weight2), self._wgrad_keys, strict=True):
            offered = getattr(param, MAIN_GRAD_ALPHA_ATTR, None) is not None
            keys.append(key if offered and param.requires_grad else None)
        return keys[0], keys[1]

    def extra_repr(self) -> str:
        lay = self.layout
        return (
            f"experts={lay.local}/{lay.experts}, hidden={lay.hidden}, "
            f"ffn={lay.ffn_local}/{lay.ffn}, gated={lay.gated}, gemm={self.gemm}, "
            f"fp8={self.fp8_weight1 is not None}"
        )
