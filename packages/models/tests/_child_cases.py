"""Named test cases run together in one child process, in the Triton interpreter when there is
no GPU (``TRITON_INTERPRET=1`` must be set before triton is first imported, so not in the
pytest process, which may have imported it already), the compiled kernels on CUDA.

A test module defines ``CASES: dict[str, Callable[[], None]]`` and a module fixture returning
``child_case_results(__file__)``; each case's test asserts that its entry is ``"ok"``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable

import torch


def run_cases(cases: dict[str, Callable[[], None]]) -> None:
    """In the child: every case, then one JSON line ``{case: "ok" or the traceback}``."""
    results = {}
    for name, case in cases.items():
        try:
            case()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    print(json.dumps(results))


def child_case_results(test_file: str, timeout: int = 600) -> dict[str, str]:
    """Run ``test_file``'s ``CASES`` in a child process; its results by case name."""
    here = os.path.dirname(test_file)  # the tests folder, for the child's imports too
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    code = (
        "import runpy, _child_cases; "
        f"_child_cases.run_cases(runpy.run_path({test_file!r})['CASES'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    results: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return results
