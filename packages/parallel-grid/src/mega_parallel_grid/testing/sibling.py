"""A test module of the same folder, imported by its file.

Under pytest's ``--import-mode=importlib`` a test folder is not on ``sys.path``, so a test
file cannot ``import`` another one's helpers by name; :func:`sibling_module` loads it from
its path once and keeps it in ``sys.modules`` under its bare name.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["sibling_module"]


def sibling_module(test_file: str, name: str) -> ModuleType:
    """The module ``name`` (``<name>.py`` beside ``test_file``, usually ``__file__``)."""
    if name not in sys.modules:
        path = Path(test_file).with_name(f"{name}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        if not path.is_file() or spec is None or spec.loader is None:
            raise ImportError(f"no test module {name!r} beside {test_file}: {path} is missing")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(sys.modules[name])
        except BaseException:
            del sys.modules[name]  # a failed import leaves nothing half-made behind
            raise
    return sys.modules[name]
