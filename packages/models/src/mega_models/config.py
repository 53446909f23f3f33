"""GPTConfig: the shape of a GPT-style decoder, independent of how it is parallelised."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal

from mega_models.attention_config import check_attention, yarn_mscale
from mega_moe import MoEConfig, RouterConfig

__all__ = ["MOE_LAYER_LETTERS", "GPTConfig"]

#: Letters of ``moe_layer_pattern``: one per layer.
MOE_LAYER_LETTERS: dict[str, str] = {"E": "mixture of experts", "-": "dense MLP"}


@dataclass(frozen=True)
class GPTConfig:
    """A Llama/GPT-style pre-norm decoder. Derived sizes are properties; nothing is parallel here."""

    vocab_size: int = 257
    """Tokens in the vocabulary (padded up to a multiple of tp inside the model)."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer layers."""
    num_attention_heads: int = 8
    """Query heads."""
    num_query_groups: int | None = None
    """Key/value heads (GQA; 1 = MQA); None means one per query head (MHA)."""
    ffn_hidden_size: int | None = None
    """Inner width of the MLP; None means 4 * hidden (gelu) or 8/3 * hidden rounded to 64 (swiglu)."""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """Normalisation before attention, before the MLP and at the end."""
    norm_eps: float = 1e-5
    """Epsilon of the norms."""
    activation: Literal["swiglu", "gelu", "relu2"] = "swiglu"
    """MLP activation; swiglu uses a gated first projection of twice the width, relu2 is
    squared ReLU without a gate (Nemotron-H)."""
    position: Literal["rope", "learned", "none"] = "rope"
    """Rotary position embedding in attention, a learned absolute table added to the input,
    or none (Nemotron-H's attention layers, whose Mamba layers carry the order)."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    max_seq_len: int = 2048
    """Longest sequence (size of the learned position table; bound for RoPE caches)."""
    qk_norm: bool = False
    """RMS-normalise queries and keys per head before attention."""
    kv_channels: int | None = None
    """Width of one attention head when it is not hidden_size / num_attention_heads
    (Hugging Face's head_dim, e.g. 128 for Qwen3-0.6B's 16 heads of a 1024 stream);
    None derives it. Standard attention only."""
    attention: Literal["mha", "mla"] = "mha"
    """Standard multi-head attention (with GQA/MQA through num_query_groups), or DeepSeek's
    multi-head latent attention (q_lora_rank, kv_lora_rank and the qk/v head dims)."""
    q_lora_rank: int | None = None
    """MLA: width of the query's low-rank latent (down-projection, RMSNorm, up-projection);
    None projects the query directly (DeepSeek-V2-Lite)."""
    kv_lora_rank: int | None = None
    """MLA: width of the shared key/value latent (DeepSeek-V3: 512)."""
    qk_nope_head_dim: int | None = None
    """MLA: per-head query/key width without position (DeepSeek-V3: 128)."""
    qk_rope_head_dim: int | None = None
    """MLA: per-head query width with rope, and of the one rope key all heads share (64)."""
    v_head_dim: int | None = None
    """MLA: per-head value width (DeepSeek-V3: 128)."""
    rope_scaling_factor: float | None = None
    """YaRN context extension (DeepSeek's rope_scaling ``factor``; MLA only): rope
    frequencies interpolated by this factor outside the fast band; None is plain rope."""
    rope_original_max_position: int | None = None
    """YaRN: the context length the model was trained at before extension
    (``original_max_position_embeddings``); needed with rope_scaling_factor."""
    rope_beta_fast: float = 32.0
    """YaRN: rotations above which a frequency is kept as is (``beta_fast``)."""
    rope_beta_slow: float = 1.0
    """YaRN: rotations below which a frequency is fully interpolated (``beta_slow``)."""
    rope_mscale: float = 1.0
    """YaRN: ``mscale``; cos and sin are scaled by mscale(factor, mscale) /
    mscale(factor, mscale_all_dim)."""
    rope_mscale_all_dim: float = 0.0
    """YaRN: ``mscale_all_dim``; when non-zero the softmax scale is multiplied by
    mscale(factor, mscale_all_dim) ** 2 (0: not)."""
    tie_embeddings: bool = False
    """Share the input embedding with the output layer."""
    add_bias: bool = False
    """Biases in the linear layers."""
    qkv_bias: bool = False
    """A bias on the fused QKV projection only, none on the others (Qwen2); needs add_bias off."""
    hidden_dropout: float = 0.0
    """Dropout on the attention and MLP outputs before the residual add."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities."""
    fused_elementwise: bool | None = None
    """Eager mode: the MLP activation and RoPE each run as one compiled region (one kernel
    forward, one backward; :mod:`mega_models.fused_ops`), the rest eagerly; under a
    whole-model ``torch.compile`` it changes nothing. None (default): on CUDA tensors only
    (on an H100 it took the eager ``1b-bench`` step from 357.4 to 285.4 ms; on CPU the
    regions' compile time would outweigh what they save in a short run)."""
    init_std: float = 0.02
    """Standard deviation of the normal init; output projections use init_std / sqrt(2 * num_layers)."""
    num_experts: int = 0
    """Routed experts of each MoE layer; 0 makes every layer a dense MLP (no MoE)."""
    moe_top_k: int = 2
    """Experts each token is sent to."""
    moe_ffn_hidden_size: int | None = None
    """Inner width of one routed expert; None means ffn_size."""
    moe_layer_freq: int = 1
    """Every n-th layer is an MoE layer (layers 0, n, 2n, ...) unless moe_layer_pattern is set."""
    moe_layer_pattern: str | None = None
    """One letter per layer, ``E`` MoE or ``-`` dense MLP (e.g. ``-EEE``); overrides moe_layer_freq."""
    moe_shared_expert_size: int = 0
    """Inner width of the shared expert(s) every token also goes through (0: none)."""
    moe_shared_expert_gate: bool = False
    """Scale the shared experts' output by ``sigmoid(x . w)`` per token (Qwen2-MoE)."""
    moe_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3)."""
    moe_softmax_before_topk: bool = False
    """Softmax over all experts, then the top-k probabilities (else top-k logits, then softmax)."""
    moe_normalize_topk: bool = False
    """Divide the k combine weights by their sum (DeepSeek-V3 sigmoid routing)."""
    moe_scaling_factor: float = 1.0
    """Multiplies the combine weights (DeepSeek-V3's routed_scaling_factor)."""
    moe_num_groups: int | None = None
    """Group-limited routing: experts form this many groups (None: off)."""
    moe_group_topk: int | None = None
    """Group-limited routing: tokens choose inside their best this-many groups."""
    moe_group_score_topk: int | None = None
    """Group-limited routing: a group scores the sum of its best this-many expert scores
    (None: moe_top_k // moe_group_topk, Megatron's rule; DeepSeek-V3 sums 2)."""
    moe_aux_loss_coeff: float = 0.0
    """Switch-style load-balancing loss coefficient (per micro-batch; 0: off)."""
    moe_seq_aux_loss_coeff: float = 0.0
    """Sequence-level load-balancing loss coefficient (DeepSeek-V3; 0: off)."""
    moe_z_loss_coeff: float = 0.0
    """Router z-loss coefficient (0: off)."""
    moe_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert routing bias moved toward balance after each step."""
    moe_bias_update_rate: float = 1e-3
    """Step of the expert-bias update."""
    moe_capacity_factor: float | None = None
    """Token dropping: each expert takes at most factor * tokens * top_k / experts (None: no drop)."""
    moe_drop_policy: Literal["probs", "position"] = "probs"
    """Which tokens an over-full expert keeps: the highest weights, or the first ones."""
    moe_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens travel to their experts over ep."""
    moe_grouped_experts: bool = True
    """One grouped GEMM over all local experts (else a loop of expert modules)."""
    moe_expert_fp8: bool = False
    """The routed experts' forward and input-gradient GEMMs in FP8 (e4m3, one scale per
    token row and per weight row; mega-moe's ``MoEConfig.expert_fp8``); needs grouped
    experts, and on CUDA an sm90+ GPU with bf16 training."""
    mtp_num_layers: int = 0
    """Multi-token prediction depth D (DeepSeek-V3): module k predicts token t + 1 + k from
    depth k-1's hidden state and the embedding of token t + k (0: off)."""
    mtp_loss_scale: float = 0.1
    """lambda: the training loss adds lambda times the mean of the D MTP losses."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be a positive integer")
        if (
            self.kv_channels is None
            and self.attention == "mha"
            and (self.hidden_size % self.num_attention_heads)
        ):
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); choose a multiple of the head count, or set "
                "kv_channels"
            )
        groups = self.kv_heads
        if groups < 1 or self.num_attention_heads % groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not divisible by "
                f"num_query_groups ({groups}); choose a divisor of the head count"
            )
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            raise ValueError(f"ffn_hidden_size ({self.ffn_hidden_size}) must be positive or None")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"norm ({self.norm!r}) must be 'rmsnorm' or 'layernorm'")
        if self.activation not in ("swiglu", "gelu", "relu2"):
            raise ValueError(
                f"activation ({self.activation!r}) must be 'swiglu', 'gelu' or 'relu2'"
            )
        if self.position not in ("rope", "learned", "none"):
            raise ValueError(f"position ({self.position!r}) must be 'rope', 'learned' or 'none'")
        m = self.mtp_num_layers
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ValueError(f"mtp_num_layers ({m!r}) must be a non-negative integer; 0 is off")
        if not self.mtp_loss_scale >= 0.0:
            raise ValueError(f"mtp_loss_scale ({self.mtp_loss_scale!r}) must be >= 0")
        check_attention(self)
        if self.position == "rope" and self.rope_dim % 2:
            raise ValueError(
                f"the rope head dim ({self.rope_dim}) must be even for rope; change "
                "hidden_size, heads, kv_channels or qk_rope_head_dim"
            )
        if self.add_bias and self.qkv_bias:
            raise ValueError(
                "qkv_bias (True) asks for a bias on the QKV projection only, but add_bias (True) "
                "already puts one on every linear; set one of them to false"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} ({p}) must be in [0, 1)")
        self._check_moe()

    def _check_moe(self) -> None:
        e = self.num_experts
        if not isinstance(e, int) or isinstance(e, bool) or e < 0:
            raise ValueError(f"num_experts ({e!r}) must be a non-negative integer; 0 means dense")
        if e == 0:
            if self.moe_expert_fp8:
                raise ValueError(
                    "moe_expert_fp8 runs the routed experts in fp8, but num_experts is 0; "
                    "set num_experts > 0 or turn moe_expert_fp8 off"
                )
            return
        if not isinstance(self.moe_top_k, int) or not 1 <= self.moe_top_k <= e:
            raise ValueError(
                f"moe_top_k ({self.moe_top_k!r}) must be between 1 and num_experts ({e}); "
                f"choose moe_top_k <= {e}"
            )
        if not isinstance(self.moe_layer_freq, int) or self.moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq ({self.moe_layer_freq!r}) must be a positive integer")
        pattern = self.moe_layer_pattern
        if pattern is not None:
            bad = sorted({ch for ch in str(pattern) if ch not in MOE_LAYER_LETTERS})
            if not isinstance(pattern, str) or bad or len(pattern) != self.num_layers:
                raise ValueError(
                    f"moe_layer_pattern ({pattern!r}) must have one letter per layer "
                    f"({self.num_layers}), each 'E' (MoE) or '-' (dense MLP)"
                )
            if "E" not in pattern:
                raise ValueError(
                    f"moe_layer_pattern ({pattern!r}) has no MoE layer; add an 'E' or set "
                    "num_experts to 0"
                )
        if self.add_bias:
            raise ValueError(
                "add_bias is not supported with MoE layers (experts have no biases); "
                "set add_bias to false or num_experts to 0"
            )
        try:
            self.moe_config()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"invalid MoE setting: {exc}") from None

    @property
    def is_moe(self) -> bool:
        """True when some layers are mixtures of experts."""
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (global, from 0) is an MoE layer."""
        if self.num_experts == 0:
            return False
        if self.moe_layer_pattern is not None:
            return self.moe_layer_pattern[index] == "E"
        return index % self.moe_layer_freq == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Global indices of the MoE layers."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def moe_ffn_size(self) -> int:
        """The inner width of one routed expert actually used."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_size

    def moe_config(self) -> MoEConfig:
        """The mega-moe settings of this model's MoE layers (needs num_experts > 0)."""
        if self.num_experts == 0:
            raise ValueError("moe_config() needs num_experts > 0; this config is dense")
        activation = self.activation
        if activation == "relu2":
            raise ValueError(
                "activation 'relu2' is built for dense MLPs only; MoE experts take 'swiglu' or "
                "'gelu', so choose one of them or set num_experts to 0"
            )
        router = RouterConfig(
            num_experts=self.num_experts, top_k=self.moe_top_k,
            score_function=self.moe_score_function,
            softmax_before_topk=self.moe_softmax_before_topk,
            normalize_topk=self.moe_normalize_topk, scaling_factor=self.moe_scaling_factor,
            num_groups=self.moe_num_groups, group_topk=self.moe_group_topk,
            group_score_topk=self.moe_group_score_topk,
            aux_loss_coeff=self.moe_aux_loss_coeff, seq_aux_loss_coeff=self.moe_seq_aux_loss_coeff,
            z_loss_coeff=self.moe_z_loss_coeff, expert_bias=self.moe_expert_bias,
            bias_update_rate=self.moe_bias_update_rate, capacity_factor=self.moe_capacity_factor,
            drop_policy=self.moe_drop_policy,
        )  # fmt: skip
        return MoEConfig(
            router=router, ffn_hidden_size=self.moe_ffn_size, activation=activation,
            dispatcher=self.moe_dispatcher,
            experts="grouped" if self.moe_grouped_experts else "sequential",
            shared_ffn_size=self.moe_shared_expert_size,
            shared_expert_gate=self.moe_shared_expert_gate, aux_loss_in_backward=True,
            expert_fp8=self.moe_expert_fp8,
        )  # fmt: skip

    @property
    def head_dim(self) -> int:
        """Width of one query/key head: kv_channels or hidden / heads (MHA), qk_nope +
        qk_rope (MLA)."""
        if self.attention == "mla":
            return (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0)
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    @property
    def v_dim(self) -> int:
        """Width of one value head (the head dim, or MLA's v_head_dim)."""
        return self.v_head_dim or 0 if self.attention == "mla" else self.head_dim

    @property
    def rope_dim(self) -> int:
        """Width that rope rotates: the whole head (MHA) or MLA's qk_rope_head_dim."""
        return self.qk_rope_head_dim or 0 if self.attention == "mla" else self.head_dim

    @property
    def softmax_scale(self) -> float:
        """Attention's score scale: 1/sqrt(head dim), times YaRN's mscale(factor,
        mscale_all_dim) ** 2 when rope scaling sets mscale_all_dim."""
        scale = 1.0 / math.sqrt(self.head_dim)
        if self.rope_scaling_factor is not None and self.rope_mscale_all_dim:
            scale *= yarn_mscale(self.rope_scaling_factor, self.rope_mscale_all_dim) ** 2
        return scale

    @property
    def kv_heads(self) -> int:
        """Key/value heads (num_query_groups, or one per query head)."""
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def ffn_size(self) -> int:
        """The MLP inner width actually used."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.activation in ("gelu", "relu2"):
            return 4 * self.hidden_size
        return (int(8 * self.hidden_size / 3) + 63) // 64 * 64

    def replace(self, **changes: Any) -> GPTConfig:
        """A copy with some fields changed (validated again)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(
                f"GPTConfig has no field {', '.join(unknown)}; known fields: {', '.join(sorted(known))}"
            )
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return GPTConfig(**values)
