"""The megatron-core peer, driven through its library API on one GPU (no Transformer Engine).

    python3 bench/peers/mcore.py --mb 4                    # as shipped: the local layer spec
    python3 bench/peers/mcore.py --mb 8 --sdpa --fused-adam

megatron-core's own pieces at mega's benchmark shape: ``GPTModel`` with
``get_gpt_layer_local_spec(normalization="RMSNorm")`` (its pure-PyTorch modules), bf16
parameters through ``Float16Module``, its ``DistributedDataParallel`` (fp32 main
gradients) and ``get_megatron_optimizer`` (distributed optimizer, fp32 masters, clip 1.0).
Without TE or Apex the local spec's core attention is unfused (scores materialised) and the
optimizer is torch's AdamW (foreach). ``--sdpa`` replaces the core attention with causal
``scaled_dot_product_attention`` and ``--fused-adam`` makes torch's AdamW fused: both are
changes a user would make, not part of megatron-core. The wheel travels to the device
(see bench/RESULTS.md for the carry line); mega does not depend on it.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import SHAPE, record, time_steps


def _fuse_torch_adamw() -> None:
    base = torch.optim.AdamW

    class Fused(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["fused"] = True
            kwargs.pop("foreach", None)
            super().__init__(*args, **kwargs)

    torch.optim.AdamW = Fused  # type: ignore[misc]


def _sdpa_core(base: type) -> type:
    class SdpaCore(base):  # type: ignore[misc, valid-type]
        """``[s, b, heads, d]`` q, k, v -> ``[s, b, heads*d]``, causal, through SDPA."""

        def forward(self, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return out.permute(2, 0, 1, 3).flatten(2)

    return SdpaCore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--sdpa", action="store_true")
    ap.add_argument("--fused-adam", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):
        os.environ.setdefault(key, value)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    if args.fused_adam:
        _fuse_torch_adamw()

    import megatron.core
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    s = SHAPE
    config = TransformerConfig(
        num_layers=s.layers, hidden_size=s.hidden, num_attention_heads=s.heads,
        ffn_hidden_size=s.ffn, kv_channels=s.hidden // s.heads, normalization="RMSNorm",
        layernorm_epsilon=1e-5, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        transformer_impl="local", masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if args.sdpa:
        spec.submodules.self_attention.submodules.core_attention = _sdpa_core(DotProductAttention)
    model: Any = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=s.vocab, max_sequence_length=s.seq,
        share_embeddings_and_output_weights=False, position_embedding_type="rope",
    ).cuda()  # fmt: skip
    model = Float16Module(config, model)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = DistributedDataParallel(config=config, ddp_config=ddp, module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=3e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
            bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True,
            clip_grad=1.0,
        ),
        [model],
        use_gloo_process_groups=False,
    )  # fmt: skip
    tokens = torch.randint(0, s.vocab, (args.mb, s.seq + 1), device="cuda")
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(s.seq, device="cuda").expand(args.mb, -1)

    def step() -> torch.Tensor:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(inputs, positions, None, labels=labels).float().mean()  # [b, s] -> mean
        loss.backward()
        model.finish_grad_sync()
        optimizer.step()
        return loss.detach()

    times, loss = time_steps(step, args.warmup, args.steps)
    result = {"system": "megatron-core", "attn": "sdpa" if args.sdpa else "local",
              "fused_adam": args.fused_adam, "compile": False, "mb": args.mb,
              "mcore_version": megatron.core.__version__, "loss": float(loss)}  # fmt: skip
    record(result, times, args.mb * s.seq, s)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
