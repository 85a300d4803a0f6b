"""The planner imports and answers without torch: fresh interpreters that block torch (the planner itself:
tests/pure/planner/test_planner_hardware.py, test_planner_timing.py).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/planner/test_planner_no_torch.py
"""
from __future__ import annotations

import subprocess
import sys

from helpers.launch import REPO


def test_planner_imports_without_torch():
    code = "import sys, hpctrain.planner.hardware; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_no_torch():
    code = "import sys, hpctrain.planner.timing; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
