"""Run a Triton kernel's test in a child process: compiled on CUDA, interpreted without a GPU.

Triton reads ``TRITON_INTERPRET`` when it is imported, so a test that wants the interpreter
(no GPU here) cannot switch it on inside the test session: the check runs in a fresh
Python with the variable set. On a CUDA machine the child compiles the kernel instead.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

__all__ = ["run_kernel_child"]


def run_kernel_child(code: str, timeout: float = 300.0) -> str:
    """Run Python source ``code`` in a child (``TRITON_INTERPRET=1`` without CUDA) and return
    its stdout; a child that fails raises AssertionError with the end of its stderr."""
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
