"""Persistent buffers of the model chunks (MoE expert biases), saved beside the weights.

They are replicated (every rank of a stage holds the same values), so they are keyed by
their path alone and any layout loads them as they are.
"""

from __future__ import annotations

from torch import Tensor

from mega_pretrain.build import Built

__all__ = ["BUFFER_PREFIX", "saved_buffers"]

#: Key prefix of buffers in the checkpoint's tensor store.
BUFFER_PREFIX = "buffer/"


def saved_buffers(built: Built) -> dict[str, Tensor]:
    """``{"buffer/<path>": tensor}`` for every persistent buffer of this rank's chunks."""
    out: dict[str, Tensor] = {}
    for chunk in built.chunks:
        persistent = set(chunk.state_dict(keep_vars=True))
        for path, buf in chunk.named_buffers():
            if path in persistent:
                out[BUFFER_PREFIX + path] = buf
    return out
