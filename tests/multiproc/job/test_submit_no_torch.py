"""A submission from the login node imports no torch: the layout, the planner and the data checks (records, shapes,
tokenizers; hpctrain.data.sources) answer without it. A fresh interpreter whose `import torch` fails runs
`hpctrain submit --dry-run` on the bundled example, once with its corpus file and once with a file whose ids no
record proves (named for the job's start), and once refused (a missing validation split).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/job/test_submit_no_torch.py
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np

from helpers.launch import EXAMPLE, REPO

DRY_RUN = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
from hpctrain.cli.main import main
main(["submit", sys.argv[1], "--dry-run", *sys.argv[2:]])
"""


def _dry_run(*sets: str) -> subprocess.CompletedProcess:
    args = [a for s in sets for a in ("--set", s)]
    return subprocess.run([sys.executable, "-c", DRY_RUN, str(EXAMPLE), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_dry_run_checks_the_data_without_torch(tmp_path):
    done = _dry_run("train.eval_every=0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "srun" in done.stdout  # the sbatch script was printed: the whole submission path ran

    raw = tmp_path / "raw.bin"  # no record beside it: its ids are left for the job's start
    np.arange(4096, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(raw)
    done = _dry_run(f"data.path='{raw}'", "train.eval_every=0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "raw.bin" in done.stdout and "at job start" in done.stdout

    done = _dry_run(f"data.path='{raw}'", "train.eval_every=10")  # no raw.val.bin: a dry run warns and names it
    assert done.returncode == 0, done.stdout + done.stderr
    assert "raw.val.bin" in done.stdout + done.stderr and "ImportError" not in done.stderr
