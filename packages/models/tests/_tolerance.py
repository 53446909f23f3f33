"""The reduction length of a whole model, for ``assert_close_to_reference`` in the contract tests.

A layout reorders the float sums of every layer; the error of one output or gradient
element gathers the rounding of the whole chain of sums behind it (see
``mega_parallel_grid.testing.tolerance``). Per layer that chain is at most the norm, the
input and output projections (Mamba's inner width is 2h) and the attention or scan over
the sequence, plus the MLP's ffn width: 4·h + ffn + seq. The model adds the final norm and
the head (h) and the softmax over the vocabulary; backward retraces the forward, and a
weight gradient then sums over the tokens. Optimizer steps repeat it all, so ``steps``
multiplies it. It is a stated over-estimate: the bound grows only as its square root.
"""

from __future__ import annotations

from mega_models import GPTConfig


def forward_reduction_length(config: GPTConfig, *, seq: int) -> int:
    """``n`` for one forward of ``config`` on sequences of ``seq`` (a loss, an output)."""
    h = config.hidden_size
    per_layer = 4 * h + max(config.ffn_size, config.moe_ffn_size) + seq
    layers = config.num_layers + config.mtp_num_layers  # an MTP depth is one more layer
    return layers * per_layer + h + config.vocab_size


def model_reduction_length(config: GPTConfig, *, seq: int, tokens: int, steps: int = 1) -> int:
    """``n`` for one forward and backward of ``config`` on ``tokens`` tokens of ``seq``."""
    return steps * (2 * forward_reduction_length(config, seq=seq) + tokens)
