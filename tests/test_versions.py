"""Every package's ``__version__`` is the version its pyproject.toml declares."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "mega_parallel_grid": "packages/parallel-grid",
    "mega_tp_layers": "packages/tp-layers",
    "mega_pipeline": "packages/pipeline",
    "mega_zero_optim": "packages/zero-optim",
    "mega_moe": "packages/moe",
    "mega_models": "packages/models",
    "mega_pretrain": "apps/pretrain",
}


@pytest.mark.parametrize("module", sorted(PACKAGES))
def test_version_is_the_pyproject_version(module: str) -> None:
    project = tomllib.loads((ROOT / PACKAGES[module] / "pyproject.toml").read_text())["project"]
    package = importlib.import_module(module)
    assert "__version__" in package.__all__
    assert package.__version__ == project["version"], (module, project["name"])
