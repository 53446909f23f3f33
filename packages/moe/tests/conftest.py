"""Puts this folder on ``sys.path`` once, so its test modules import the shared helper
modules here (``_*.py``) by name.

Pytest runs with ``--import-mode=importlib``, which adds no test folder to ``sys.path``;
the dist pool's worker processes start after collection and inherit this ``sys.path``.
"""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
