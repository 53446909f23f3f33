"""``sibling_module`` loads a test module beside the caller's file, once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mega_parallel_grid.testing import sibling_module


def test_loads_the_module_beside_the_file_once(tmp_path: Path) -> None:
    (tmp_path / "helper_for_sibling_test.py").write_text("VALUE = 41\n")
    caller = str(tmp_path / "test_caller.py")
    try:
        module = sibling_module(caller, "helper_for_sibling_test")
        assert module.VALUE == 41
        module.VALUE = 42
        assert sibling_module(caller, "helper_for_sibling_test").VALUE == 42  # the same module
    finally:
        sys.modules.pop("helper_for_sibling_test", None)


def test_a_missing_module_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(ImportError, match=r"no_such_sibling_module\.py is missing"):
        sibling_module(str(tmp_path / "test_caller.py"), "no_such_sibling_module")
    assert "no_such_sibling_module" not in sys.modules
