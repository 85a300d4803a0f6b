"""The GPU speed proof's script (benchmarks/gpu_perf.py, run by tests/device/gpu_perf.sh where a GPU is lent) runs
here in its --tiny mode, so it does not rot between GPU sessions: both sides train the same model on the same data
(identical losses in fp32 eager), and the results carry a verdict per judged ratio. No timing is judged here.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/bench/test_gpu_perf_script.py
"""
from __future__ import annotations

import json
import subprocess
import sys

from helpers.launch import REPO, env_with_venv


def test_the_gpu_script_runs_on_a_cpu(tmp_path) -> None:
    out = subprocess.run([sys.executable, "gpu_perf.py", "--tiny", "--modes", "eager", "--layers", "1", "--rounds", "2",
                          "--steps", "1", "--warmup", "1", "--run-root", str(tmp_path / "runs"), "--results",
                          str(tmp_path)], cwd=REPO / "benchmarks", capture_output=True, text=True, timeout=300,
                         env=env_with_venv())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_perf-cpu.json").read_text())
    assert doc["device"] == "cpu" and doc["modes"] == ["eager"] and doc["torch"] and doc["complete"]
    losses = doc["losses"]["eager"]
    assert losses["ours"] == losses["plain"] and len(losses["ours"]) == 3, losses
    assert [v["metric"] for v in doc["verdicts"]] == ["eager: tokens/s ours / plain loop"]
    assert doc["rows"]["eager/ours"]["tokens_per_s"] > 0


def test_without_a_gpu_it_says_so_rather_than_measuring_a_cpu(tmp_path) -> None:
    """A device run whose python has a CPU-only torch (the wrong venv carried over) must fail, not write a CPU
    result that looks like the GPU's."""
    out = subprocess.run([sys.executable, "gpu_perf.py", "--results", str(tmp_path)], cwd=REPO / "benchmarks",
                         capture_output=True, text=True, timeout=120, env=env_with_venv())
    assert out.returncode == 2 and "sees no CUDA device" in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
    assert not list(tmp_path.iterdir())
