"""The README's example, taken from the README itself, run as written under torchrun on 2 ranks.

Two runs, because the failure it guards against (a gloo worker thread ended during
interpreter exit, exit code -6 after the right output) showed in about one run in three
(two runs catch it 5 times in 9; a third run cost the suite ~25 s of its 2 cores).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

README = Path(__file__).resolve().parents[1] / "README.md"
RUNS = 2


def _example_code() -> str:
    text = README.read_text()
    section = text.split("## Example", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the README's Example section has no python block"
    return match.group(1)


def _unsplit_losses() -> list[float]:
    """The losses of the README's stack in one process (the same seed and draws)."""
    hidden, layers, m, shape = 64, 8, 4, (16, 2, 64)
    torch.manual_seed(0)
    stack = nn.Sequential(
        *[nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(layers)]
    )
    data = [(torch.randn(shape), torch.randn(shape)) for _ in range(m)]
    with torch.no_grad():
        return [float(F.mse_loss(stack(x), y)) for x, y in data]


def test_readme_example_runs_and_prints_the_unsplit_losses(tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(_example_code())
    expected = _unsplit_losses()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(script)]
    for run in range(RUNS):
        done = subprocess.run(
            command, cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"run {run + 1} of {RUNS} exited {done.returncode}:\n{output}"
        printed = [line for line in done.stdout.splitlines() if line.startswith("[")]
        assert len(printed) == 1, f"run {run + 1}: expected one line of losses:\n{output}"
        losses = ast.literal_eval(printed[0])
        assert len(losses) == len(expected)
        for got, want in zip(losses, expected, strict=True):
            assert abs(got - want) <= 5e-5 + 1e-6 * abs(want), (losses, expected)  # 4 decimals
