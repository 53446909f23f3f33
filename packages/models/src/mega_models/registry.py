"""Named model sizes."""

from __future__ import annotations

from mega_models.config import GPTConfig

__all__ = ["MODEL_SIZES", "model_config"]

MODEL_SIZES: dict[str, GPTConfig] = {
    # CPU, seconds: the contract tests' and the default trainer's model (vocab not divisible by tp).
    "tiny": GPTConfig(
        vocab_size=257, hidden_size=64, num_layers=8, num_attention_heads=8,
        num_query_groups=4, ffn_hidden_size=128, max_seq_len=256,
    ),
    "125m": GPTConfig(
        vocab_size=50304, hidden_size=768, num_layers=12, num_attention_heads=12,
        ffn_hidden_size=2048, max_seq_len=2048, tie_embeddings=True,
    ),
    "1b": GPTConfig(
        vocab_size=32000, hidden_size=2048, num_layers=22, num_attention_heads=16,
        num_query_groups=4, ffn_hidden_size=5632, max_seq_len=2048,
    ),
    # The shape the peers were measured on (ANCHORS.md): MHA, 24 layers, seq 2048.
    "1b-bench": GPTConfig(
        vocab_size=32000, hidden_size=2048, num_layers=24, num_attention_heads=16,
        ffn_hidden_size=5632, max_seq_len=2048,
    ),
    # CPU MoE, Mixtral-style: every layer 8 experts, top-2 (top-k logits, then softmax), switch aux loss.
    "mixtral-tiny": GPTConfig(
        vocab_size=257, hidden_size=64, num_layers=4, num_attention_heads=8,
        num_query_groups=4, ffn_hidden_size=128, max_seq_len=256, num_experts=8, moe_top_k=2,
        moe_ffn_hidden_size=128, moe_aux_loss_coeff=1e-2,
    ),
    # CPU MoE, DeepSeek-V3-style: a dense first layer, 16 fine-grained experts, top-4 in the
    # best 2 of 4 groups, sigmoid scores normalised over the k, one shared expert, aux-loss-free
    # expert bias plus a small sequence-level balance loss.
    "moe-tiny": GPTConfig(
        vocab_size=257, hidden_size=64, num_layers=4, num_attention_heads=8,
        num_query_groups=4, ffn_hidden_size=128, max_seq_len=256, num_experts=16, moe_top_k=4,
        moe_ffn_hidden_size=32, moe_layer_pattern="-EEE", moe_shared_expert_size=32,
        moe_score_function="sigmoid", moe_normalize_topk=True, moe_num_groups=4,
        moe_group_topk=2, moe_expert_bias=True, moe_seq_aux_loss_coeff=1e-4,
    ),
    # GPU MoE for the ep scaling runs (issue 12), Mixtral-style: 12 layers of 16 experts, top-2.
    "moe-2b": GPTConfig(
        vocab_size=32000, hidden_size=2048, num_layers=12, num_attention_heads=16,
        num_query_groups=4, ffn_hidden_size=5632, max_seq_len=4096, num_experts=16, moe_top_k=2,
        moe_ffn_hidden_size=1408, moe_aux_loss_coeff=1e-2,
    ),
    # GPU MoE, DeepSeek-style fine-grained: a dense first layer, then 64 experts, top-6 in the
    # best 4 of 8 groups, sigmoid scores, one shared expert, aux-loss-free expert bias.
    "deepseek-3b": GPTConfig(
        vocab_size=32000, hidden_size=2048, num_layers=12, num_attention_heads=16,
        num_query_groups=4, ffn_hidden_size=5632, max_seq_len=4096, num_experts=64, moe_top_k=6,
        moe_ffn_hidden_size=704, moe_layer_pattern="-" + "E" * 11, moe_shared_expert_size=1408,
        moe_score_function="sigmoid", moe_normalize_topk=True, moe_num_groups=8,
        moe_group_topk=4, moe_expert_bias=True, moe_seq_aux_loss_coeff=1e-4,
    ),
    # CPU DeepSeek-V3-style: multi-head latent attention (q latent 32, kv latent 16, qk head
    # 8 + 4 rope, value head 8), moe-tiny's routing (dense first layer, 16 experts top-4 in
    # the best 2 of 4 groups, sigmoid, shared expert, expert bias) and one MTP module.
    "deepseek-v3-tiny": GPTConfig(
        vocab_size=257, hidden_size=64, num_layers=4, num_attention_heads=8,
        ffn_hidden_size=128, max_seq_len=256, norm_eps=1e-6, attention="mla", q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        num_experts=16, moe_top_k=4, moe_ffn_hidden_size=32, moe_layer_pattern="-EEE",
        moe_shared_expert_size=32, moe_score_function="sigmoid", moe_normalize_topk=True,
        moe_num_groups=4, moe_group_topk=2, moe_expert_bias=True, moe_seq_aux_loss_coeff=1e-4,
        mtp_num_layers=1,
    ),
    # GPU DeepSeek-V3 shape at ~3.6B (one H200, bf16 + AdamW): deepseek-3b's MoE (dense
    # first layer, 64 experts top-6 in the best 4 of 8 groups, sigmoid, expert bias) with
    # V3's MLA (q latent 768, kv latent 512, qk 128 + 64 rope, value 128), one shared
    # expert of the routed width and one MTP module; a group scores its best 2 experts, as
    # V3's router does (so it exports as DeepseekV3ForCausalLM).
    "deepseek-v3-3b": GPTConfig(
        vocab_size=32000, hidden_size=2048, num_layers=12, num_attention_heads=16,
        ffn_hidden_size=5632, max_seq_len=4096, norm_eps=1e-6, attention="mla",
        q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, num_experts=64, moe_top_k=6, moe_ffn_hidden_size=704,
        moe_layer_pattern="-" + "E" * 11, moe_shared_expert_size=704,
        moe_score_function="sigmoid", moe_normalize_topk=True, moe_num_groups=8,
        moe_group_topk=4, moe_group_score_topk=2, moe_expert_bias=True,
        moe_seq_aux_loss_coeff=1e-4, mtp_num_layers=1,
    ),
    # CPU Qwen3-style dense: GQA, per-head RMSNorm on q and k (qk_norm), tied embeddings,
    # rope_theta 1e6, norm eps 1e-6 (converts to and from Qwen3ForCausalLM).
    "qwen3-tiny": GPTConfig(
        vocab_size=257, hidden_size=64, num_layers=4, num_attention_heads=4,
        num_query_groups=2, ffn_hidden_size=192, max_seq_len=256, norm_eps=1e-6,
        rope_theta=1e6, qk_norm=True, tie_embeddings=True,
    ),
    # CPU Qwen3-MoE-style: qk_norm, 8 experts top-2 (softmax over all experts, the k
    # renormalised: norm_topk_prob), no shared expert, a dense first layer (mlp_only_layers).
    "qwen3-moe-tiny": GPTConfig(
        vocab_size=257, hidden_size=64, num_layers=4, num_attention_heads=4,
        num_query_groups=2, ffn_hidden_size=128, max_seq_len=256, norm_eps=1e-6,
        rope_theta=1e6, qk_norm=True, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=32,
        moe_layer_pattern="-EEE", moe_softmax_before_topk=True, moe_normalize_topk=True,
        moe_aux_loss_coeff=1e-3,
    ),
    # Qwen3-1.7B shape: head dim 128 (= hidden / heads), FFN 6144, tied embeddings.
    "qwen3-1.7b": GPTConfig(
        vocab_size=151936, hidden_size=2048, num_layers=28, num_attention_heads=16,
        num_query_groups=8, ffn_hidden_size=6144, max_seq_len=40960, norm_eps=1e-6,
        rope_theta=1e6, qk_norm=True, tie_embeddings=True,
    ),
    # Llama-3-8B shape.
    "8b": GPTConfig(
        vocab_size=128256, hidden_size=4096, num_layers=32, num_attention_heads=32,
        num_query_groups=8, ffn_hidden_size=14336, max_seq_len=8192, rope_theta=500000.0,
    ),
}  # fmt: skip


def model_config(name: str) -> GPTConfig:
    """The registered config called ``name``."""
    try:
        return MODEL_SIZES[name]
    except KeyError:
        raise ValueError(
            f"unknown model size {name!r}; known sizes: {', '.join(MODEL_SIZES)}"
        ) from None
