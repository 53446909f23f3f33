"""Hugging Face bridge for dense Llama-family checkpoints (Llama 2/3, Mistral, Qwen2).

Needs the ``hf`` extra (``safetensors``); it is imported only when a file is read or written.
"""

from mega_models.hf.config import (
    HF_ARCHITECTURES,
    HFLayout,
    gpt_config_from_hf,
    hf_config_from_gpt,
    hf_layout,
    read_hf_config,
)
from mega_models.hf.gather import gather_full_state
from mega_models.hf.load import load_hf_weights
from mega_models.hf.mapping import (
    TensorMap,
    fuse_qkv,
    hf_tensor_names,
    interleave_gate_up,
    split_gate_up,
    split_qkv,
    tensor_map,
)
from mega_models.hf.reader import SafetensorsReader
from mega_models.hf.save import hf_state_dict, save_hf_checkpoint, write_safetensors

__all__ = [
    "HF_ARCHITECTURES",
    "HFLayout",
    "SafetensorsReader",
    "TensorMap",
    "fuse_qkv",
    "gather_full_state",
    "gpt_config_from_hf",
    "hf_config_from_gpt",
    "hf_layout",
    "hf_state_dict",
    "hf_tensor_names",
    "interleave_gate_up",
    "load_hf_weights",
    "read_hf_config",
    "save_hf_checkpoint",
    "split_gate_up",
    "split_qkv",
    "tensor_map",
    "write_safetensors",
]
