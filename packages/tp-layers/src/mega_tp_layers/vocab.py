"""Vocabulary padding and ranges: pure arithmetic, no processes.

The rule: a vocabulary of ``V`` tokens split over ``tp`` ranks is padded to
``ceil(V / (tp * multiple_of)) * tp * multiple_of`` rows. Rank ``r`` holds rows
``[r * V_pad/tp, (r+1) * V_pad/tp)``. Padding rows are zero, no valid token id selects
them, and :func:`~mega_tp_layers.vocab_parallel_cross_entropy` leaves their logits out of
the softmax (``vocab_size=V``), so the loss is that of the unpadded vocabulary.
"""

from __future__ import annotations

__all__ = ["padded_vocab_size", "vocab_range"]


def padded_vocab_size(vocab_size: int, tp: int, multiple_of: int = 1) -> int:
    """Smallest multiple of ``tp * multiple_of`` that holds ``vocab_size`` tokens."""
    for name, value in (("vocab_size", vocab_size), ("tp", tp), ("multiple_of", multiple_of)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} ({value!r}) must be a positive integer")
    step = tp * multiple_of
    return -(-vocab_size // step) * step


def vocab_range(padded_size: int, tp: int, rank: int) -> tuple[int, int]:
    """The ``[start, end)`` rows of a padded vocabulary that tp rank ``rank`` holds."""
    if padded_size % tp != 0:
        raise ValueError(
            f"padded vocabulary ({padded_size}) is not divisible by tp ({tp}); "
            "use padded_vocab_size(vocab_size, tp)"
        )
    if not 0 <= rank < tp:
        raise ValueError(f"rank ({rank}) must lie in [0, {tp})")
    per_rank = padded_size // tp
    return rank * per_rank, (rank + 1) * per_rank
