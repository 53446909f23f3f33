"""Document-aware packing from the trainer's config: Megatron's ``data.reset_position_ids``,
``data.reset_attention_mask`` and ``data.eod_mask_loss``.

The documents of a packed sample are found from its token ids and the tokenizer's EOD id
(the on-disk format is unchanged); :mod:`mega_models.doc_mask` does the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mega_pretrain.data.tokenizers import build_tokenizer

if TYPE_CHECKING:
    from mega_models import GPTConfig
    from mega_models.doc_mask import DocumentPacking
    from mega_pretrain.config import TrainerConfig

__all__ = ["check_packing", "packing_for"]


def _switches(config: TrainerConfig) -> dict[str, bool]:
    d = config.data
    return {"reset_position_ids": d.reset_position_ids,
            "reset_attention_mask": d.reset_attention_mask, "eod_mask_loss": d.eod_mask_loss}  # fmt: skip


def packing_for(config: TrainerConfig) -> DocumentPacking | None:
    """The packing the config asks for (the EOD id of ``data.tokenizer``), or None when
    every switch is off."""
    switches = _switches(config)
    if not any(switches.values()):
        return None
    from mega_models.doc_mask import DocumentPacking

    return DocumentPacking(build_tokenizer(config.data.tokenizer).eod_id, **switches)


def check_packing(config: TrainerConfig, model: GPTConfig, family: str) -> None:
    """One ``ValueError`` sentence for a packing switch the model or layout cannot honour."""
    d, p = config.data, config.parallel
    on = [f"data.{name}" for name, value in _switches(config).items() if value]
    if not on:
        return
    resets = d.reset_position_ids or d.reset_attention_mask
    seq_len = config.train.seq_len
    if seq_len > model.max_seq_len:
        raise ValueError(
            f"a packed sample is train.seq_len ({seq_len}) tokens whatever {', '.join(on)} "
            "does inside it (positions and the mask restart per document; the window stays one "
            f"sequence), longer than the model's max_seq_len ({model.max_seq_len}); set "
            f"train.seq_len to at most {model.max_seq_len} or raise model.max_seq_len"
        )
    if family == "hybrid" and resets:
        raise ValueError(
            "data.reset_position_ids / reset_attention_mask are not supported for hybrid "
            "models: their Mamba layers would need their state reset at each document; turn "
            "them off (data.eod_mask_loss works) or train a GPT model"
        )
    if model.mtp_num_layers and on:
        raise ValueError(
            f"{', '.join(on)} cannot be combined with multi-token prediction (mtp_num_layers "
            f"{model.mtp_num_layers}): its shifted targets cross documents; set "
            "model.mtp_num_layers to 0 or turn the switches off"
        )
    if d.reset_position_ids and model.position == "learned":
        raise ValueError(
            "data.reset_position_ids needs model.position 'rope' or 'none', not 'learned'; "
            "change the position encoding or turn it off"
        )
    if d.reset_attention_mask and model.attention_dropout > 0:
        raise ValueError(
            f"data.reset_attention_mask does not support attention_dropout "
            f"({model.attention_dropout}); set model.attention_dropout to 0 or turn it off"
        )
    if d.reset_attention_mask and p.cp > 1 and p.cp_method != "all_gather":
        raise ValueError(
            f"data.reset_attention_mask under context parallel (cp {p.cp}) needs "
            f"parallel.cp_method all_gather, not {p.cp_method!r}; set it or turn the mask off"
        )
