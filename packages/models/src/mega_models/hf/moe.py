"""The mixture-of-experts keys of Mixtral, Qwen2-MoE and Qwen3-MoE ``config.json`` <->
GPTConfig fields.

Pure dictionaries, no torch. Routing is mapped to the mega router settings that compute
exactly what ``transformers`` computes:

* Mixtral: softmax over all experts in fp32, the top-k probabilities, divided by their
  sum -> ``moe_softmax_before_topk=True, moe_normalize_topk=True``.
* Qwen2-MoE: the same, divided by their sum only with ``norm_topk_prob`` ->
  ``moe_normalize_topk=norm_topk_prob``; a shared expert of
  ``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))``.
* Qwen3-MoE: Qwen2-MoE's routing without the shared expert (and Qwen3's per-head q/k
  norms, ``GPTConfig.qk_norm``).

Which layers are sparse: Mixtral, all; Qwen2-MoE and Qwen3-MoE, layer i when ``(i + 1) %
decoder_sparse_step == 0`` and i is not in ``mlp_only_layers`` (mega: ``moe_layer_pattern``).

``router_aux_loss_coef`` and ``output_router_logits`` are not mapped: they set
transformers' own training loss (pooled over all layers), which is not mega's per-layer
loss; choose ``moe_aux_loss_coeff`` for training in mega.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mega_models.config import GPTConfig

__all__ = [
    "MIXTRAL",
    "MOE_ARCHITECTURES",
    "QWEN2_MOE",
    "QWEN3_MOE",
    "check_moe_export",
    "hf_moe_keys",
    "moe_fields_from_hf",
    "qwen2_moe_pattern",
    "qwen2_moe_sparse_step",
    "routing_semantics",
]

MIXTRAL, QWEN2_MOE = "MixtralForCausalLM", "Qwen2MoeForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
#: The mixture-of-experts architectures the bridge reads and writes.
MOE_ARCHITECTURES = (MIXTRAL, QWEN2_MOE, QWEN3_MOE)


def routing_semantics(config: GPTConfig) -> str:
    """What the router computes, in words; equal strings mean equal combine weights.

    Top-k-of-logits-then-softmax equals softmax-then-top-k renormalised, so both read
    ``softmax, top-k renormalised``.
    """
    if config.moe_score_function == "sigmoid":
        return "sigmoid" + (", top-k renormalised" if config.moe_normalize_topk else "")
    if not config.moe_softmax_before_topk or config.moe_normalize_topk:
        return "softmax, top-k renormalised"
    return "softmax, top-k probabilities"


def qwen2_moe_pattern(
    num_layers: int, sparse_step: int, mlp_only: list[int], arch: str = QWEN2_MOE
) -> str:
    """``moe_layer_pattern`` of a Qwen2-MoE or Qwen3-MoE (``arch``): ``E`` where
    transformers builds a sparse block."""
    if not isinstance(sparse_step, int) or sparse_step < 1:
        raise ValueError(
            f"decoder_sparse_step ({sparse_step!r}) of {arch} must be a positive integer"
        )
    return "".join(
        "E" if (i + 1) % sparse_step == 0 and i not in mlp_only else "-" for i in range(num_layers)
    )


def qwen2_moe_sparse_step(config: GPTConfig, preferred: int | None = None) -> tuple[int, list[int]]:
    """``(decoder_sparse_step, mlp_only_layers)`` that place the MoE layers of ``config``.

    ``preferred`` (the original config's step) is kept when it fits; else the largest step
    whose sparse layers include every MoE layer. The dense layers it would make sparse are
    listed in ``mlp_only_layers``.
    """
    moe = set(config.moe_layers)

    def fits(step: int) -> bool:
        return all((i + 1) % step == 0 for i in moe)

    if preferred is None or not isinstance(preferred, int) or preferred < 1 or not fits(preferred):
        preferred = max(s for s in range(1, config.num_layers + 1) if fits(s))
    step = preferred
    mlp_only = [i for i in range(config.num_layers) if (i + 1) % step == 0 and i not in moe]
    return step, mlp_only


def moe_fields_from_hf(cfg: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """GPTConfig keyword arguments for the experts and router of a Mixtral / Qwen2-MoE /
    Qwen3-MoE config."""
    num_layers = int(cfg["num_hidden_layers"])
    if arch == MIXTRAL:
        jitter = float(cfg.get("router_jitter_noise") or 0.0)
        if jitter != 0.0:
            raise ValueError(
                f"router_jitter_noise ({jitter}) of {arch} is not supported by mega's router, "
                "which has no input jitter; set it to 0.0 to convert"
            )
        ffn = int(cfg["intermediate_size"])
        return {
            "num_experts": int(cfg.get("num_local_experts", cfg.get("num_experts", 8))),
            "moe_top_k": int(cfg.get("num_experts_per_tok", 2)),
            "moe_ffn_hidden_size": ffn,
            "moe_score_function": "softmax",
            "moe_softmax_before_topk": True,
            "moe_normalize_topk": True,
        }
    default_experts, dense = (60, "Qwen2") if arch == QWEN2_MOE else (128, "Qwen3")
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", default_experts)))
    if experts < 1:
        raise ValueError(
            f"num_experts ({experts}) of {arch} leaves no experts; mega imports a {arch} with "
            f"at least one expert (a model without any has the tensors of {dense}ForCausalLM)"
        )
    step = cfg.get("decoder_sparse_step", 1)
    mlp_only = [int(i) for i in cfg.get("mlp_only_layers") or []]
    pattern = qwen2_moe_pattern(num_layers, step, mlp_only, arch)
    if "E" not in pattern:
        raise ValueError(
            f"{arch} with decoder_sparse_step ({step}) and mlp_only_layers ({mlp_only}) has no "
            f"sparse layer among its {num_layers} layers; GPTModel needs at least one"
        )
    fields: dict[str, Any] = {
        "num_experts": experts,
        "moe_top_k": int(cfg.get("num_experts_per_tok", 4 if arch == QWEN2_MOE else 8)),
        "moe_ffn_hidden_size": int(
            cfg.get("moe_intermediate_size", 1408 if arch == QWEN2_MOE else 768)
        ),
        "moe_layer_pattern": None if "-" not in pattern else pattern,
        "moe_score_function": "softmax",
        "moe_softmax_before_topk": True,
        "moe_normalize_topk": bool(cfg.get("norm_topk_prob", False)),
    }
    if arch == QWEN3_MOE:  # no shared expert (transformers ignores the key if present)
        return fields
    shared = int(cfg.get("shared_expert_intermediate_size", 0))
    if shared < 1:
        raise ValueError(
            f"shared_expert_intermediate_size ({shared}) of {arch} gives an empty shared "
            "expert, which mega does not build; use a checkpoint with a shared expert"
        )
    return {**fields, "moe_shared_expert_size": shared, "moe_shared_expert_gate": True}


def check_moe_export(config: GPTConfig, arch: str) -> None:
    """Raise, in one sentence, if ``config`` cannot be written as ``arch`` (a dense one too)."""
    if arch not in MOE_ARCHITECTURES:
        if config.is_moe:
            raise ValueError(
                f"{arch} is dense but the model has {config.num_experts} experts; export it as "
                f"{' or '.join(MOE_ARCHITECTURES)}"
            )
        return
    if not config.is_moe:
        raise ValueError(
            f"{arch} is a mixture of experts but the model is dense (num_experts 0); export it "
            "as LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM"
        )
    routing = routing_semantics(config)
    for field, value, want in (
        ("moe_score_function", config.moe_score_function, "softmax"),
        ("moe_scaling_factor", config.moe_scaling_factor, 1.0),
        ("moe_num_groups", config.moe_num_groups, None),
        ("moe_expert_bias", config.moe_expert_bias, False),
    ):
        if value != want:
            raise ValueError(
                f"GPTConfig.{field} ({value!r}) changes the routing in a way {arch} cannot "
                f"express; only {field}={want!r} converts to Hugging Face"
            )
    if arch == MIXTRAL:
        dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
        if dense:
            raise ValueError(
                f"{arch} has experts in every layer but layers {dense} of the model are dense; "
                f"export it as {QWEN2_MOE}"
            )
        if config.moe_shared_expert_size:
            raise ValueError(
                f"{arch} has no shared expert but the model has one of "
                f"{config.moe_shared_expert_size}; export it as {QWEN2_MOE}"
            )
        if routing != "softmax, top-k renormalised":
            raise ValueError(
                f"{arch} renormalises the top-k softmax weights but the model routes with "
                f"'{routing}'; export it as {QWEN2_MOE} (norm_topk_prob false)"
            )
        return
    if arch == QWEN3_MOE:
        if config.moe_shared_expert_size:
            raise ValueError(
                f"{arch} has no shared expert but the model has one of "
                f"{config.moe_shared_expert_size}; set moe_shared_expert_size to 0, or export "
                f"it as {QWEN2_MOE} (without qk_norm)"
            )
        return
    if not config.moe_shared_expert_size or not config.moe_shared_expert_gate:
        raise ValueError(
            f"{arch} always has a sigmoid-gated shared expert but the model has "
            f"moe_shared_expert_size {config.moe_shared_expert_size} and moe_shared_expert_gate "
            f"{config.moe_shared_expert_gate}; export it as {MIXTRAL} or add a gated shared expert"
        )


def hf_moe_keys(config: GPTConfig, arch: str, base: Mapping[str, Any]) -> dict[str, Any]:
    """The config.json keys of the experts of ``config`` as ``arch`` (after check_moe_export).

    ``base`` is the config being written (its sliding-window and head-dim keys are kept).
    """
    if arch == MIXTRAL:
        out: dict[str, Any] = {
            "num_local_experts": config.num_experts,
            "num_experts_per_tok": config.moe_top_k,
            "intermediate_size": config.moe_ffn_size,
            "router_jitter_noise": 0.0,
        }
        return out
    preferred = base.get("decoder_sparse_step")
    step, mlp_only = qwen2_moe_sparse_step(config, preferred)
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts: keep a base's spelling
    count = (
        "num_local_experts" if "num_experts" not in base and arch == QWEN3_MOE else "num_experts"
    )
    out = {
        count: config.num_experts,
        "num_experts_per_tok": config.moe_top_k,
        "moe_intermediate_size": config.moe_ffn_size,
        "norm_topk_prob": routing_semantics(config) == "softmax, top-k renormalised",
        "decoder_sparse_step": step,
        "mlp_only_layers": mlp_only,
        "use_sliding_window": False,
    }
    if arch == QWEN2_MOE:
        out["shared_expert_intermediate_size"] = config.moe_shared_expert_size
        # biases the model lacks are written as zeros; a 4.x reader always builds them
        out["qkv_bias"] = bool(config.qkv_bias or config.add_bias or base.get("qkv_bias", True))
    return out
