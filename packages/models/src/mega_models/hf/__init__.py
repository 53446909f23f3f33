"""Hugging Face bridge for Llama-family checkpoints and their mixtures of experts.

Dense: Llama 2/3.0, Mistral, Qwen2 (q/k/v biases as ``GPTConfig.qkv_bias``), Qwen3 (per-head
q/k RMSNorm as ``GPTConfig.qk_norm``). MoE: Mixtral, Qwen2-MoE (shared expert with its
sigmoid gate, ``norm_topk_prob``, ``decoder_sparse_step`` / ``mlp_only_layers``) and
Qwen3-MoE (qk_norm, no shared expert), with routers that compute what ``transformers``
computes. DeepSeek-V3 (``DeepseekV3ForCausalLM``): latent attention (its interleaved rope
rows permuted), sigmoid group-limited routing with the correction bias, dense first
layers, the shared expert, and its MTP depths kept in and out of the safetensors. Import reads each rank's shard (tp, ep, etp, pipeline stage)
straight from the safetensors files; export gathers the full tensors and writes
config.json and safetensors shards with an index; given the config.json the model came
from, the export keeps every key of it that the export does not own (token ids...), and
:func:`copy_side_files` hands on the generation config and tokenizer files.

Nemotron-H (``NemotronHForCausalLM``) converts to and from a :class:`HybridModel`:
:func:`nemotron_h_config`, :func:`load_nemotron_h_weights`, :func:`save_nemotron_h_checkpoint`.

Needs the ``hf`` extra (``safetensors``); it is imported only when a file is read or written.
"""

from mega_models.hf.config import (
    HF_ARCHITECTURES,
    OWNED_KEYS,
    HFLayout,
    check_base_config,
    default_architecture,
    gpt_config_from_hf,
    hf_config_from_gpt,
    hf_layout,
    read_hf_config,
)
from mega_models.hf.deepseek_v3 import DEEPSEEK_V3
from mega_models.hf.files import HF_SIDE_FILES, copy_side_files
from mega_models.hf.gather import gather_full_state
from mega_models.hf.load import load_hf_weights
from mega_models.hf.mapping import (
    TensorMap,
    deinterleave_rope,
    fuse_qkv,
    gpt_parameter_names,
    hf_tensor_names,
    interleave_gate_up,
    interleave_rope,
    mtp_copies,
    split_gate_up,
    split_qkv,
    stack_grid,
    tensor_map,
    unstack_grid,
)
from mega_models.hf.moe import MOE_ARCHITECTURES, routing_semantics
from mega_models.hf.nemotron_h import (
    load_nemotron_h_weights,
    nemotron_h_config,
    save_nemotron_h_checkpoint,
)
from mega_models.hf.reader import SafetensorsReader
from mega_models.hf.save import hf_state_dict, save_hf_checkpoint, write_safetensors

__all__ = [
    "DEEPSEEK_V3",
    "HF_ARCHITECTURES",
    "HF_SIDE_FILES",
    "MOE_ARCHITECTURES",
    "OWNED_KEYS",
    "HFLayout",
    "SafetensorsReader",
    "TensorMap",
    "check_base_config",
    "copy_side_files",
    "default_architecture",
    "deinterleave_rope",
    "fuse_qkv",
    "gather_full_state",
    "gpt_config_from_hf",
    "gpt_parameter_names",
    "hf_config_from_gpt",
    "hf_layout",
    "hf_state_dict",
    "hf_tensor_names",
    "interleave_gate_up",
    "interleave_rope",
    "load_hf_weights",
    "load_nemotron_h_weights",
    "mtp_copies",
    "nemotron_h_config",
    "read_hf_config",
    "routing_semantics",
    "save_hf_checkpoint",
    "save_nemotron_h_checkpoint",
    "split_gate_up",
    "split_qkv",
    "stack_grid",
    "tensor_map",
    "unstack_grid",
    "write_safetensors",
]
