"""The registered model families: one line per family. A new family is a module beside
:mod:`mega_models.gpt_family` (its config, model and ModelSpec) and one line here."""

from __future__ import annotations

from mega_models.gpt import GPTModel
from mega_models.gpt_family import GPT_SPEC
from mega_models.hybrid import HybridModel
from mega_models.hybrid_family import HYBRID_SPEC
from mega_models.spec import register_spec

__all__ = ["ModelChunk"]

#: One pipeline chunk of any registered family (for type checkers; the spec builds it).
ModelChunk = GPTModel | HybridModel

register_spec(GPT_SPEC)
register_spec(HYBRID_SPEC)
