"""Real Slurm, end to end: a 2-node job is preempted mid-run with `scancel --signal=USR2`, checkpoints on every
rank, requeues itself, resumes from its checkpoint and finishes; its final weights equal an uninterrupted job's,
bit for bit (same layout, CPU)."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import EXAMPLE, REPO, env_with_venv, hpctrain, only_run_dir, tool

pytestmark = pytest.mark.slurm
STEPS = 60
SETS = ["--set", f"train.steps={STEPS}", "--set", "train.log_every=5", "--set", "model.n_layers=2"]


def _datasets(ckpt: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint, read with plain h5py."""
    out = {}
    for shard in sorted(ckpt.glob("*.h5")):
        with h5py.File(shard) as f:
            f.visititems(lambda name, obj: out.__setitem__(f"{shard.name}/{name}", obj[()])
                         if isinstance(obj, h5py.Dataset) and obj.dtype.kind == "f" else None)
    return out


def test_preempt_requeue_resume_matches_uninterrupted(slurm_cluster, tmp_path) -> None:
    base = hpctrain("submit", str(EXAMPLE), "--wait", *SETS, "--set", f"job.run_root={tmp_path / 'base'}",
                    timeout=600)
    assert base.returncode == 0, base.stdout + base.stderr

    cmd = [tool("hpctrain"), "submit", str(EXAMPLE), "--wait", *SETS, "--set", f"job.run_root={tmp_path / 'pre'}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_with_venv(),
                            cwd=REPO)
    lines = []
    job_id = None
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"submitted job (\d+)", line)
        job_id = job_id or (m and m.group(1))
        if re.search(r"step (1[5-9]|2\d)/", line):  # mid-run, well before the end
            subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
            break
    rest, err = proc.communicate(timeout=600)
    out = "".join(lines) + rest
    assert proc.returncode == 0, out + err
    assert "PENDING" in out.split("step 1", 1)[1]  # --wait saw the job go back to the queue and followed it

    run = only_run_dir(tmp_path / "pre")
    summary = json.loads((run / "summary.json").read_text())
    resumed = summary["train"]["resumed_from"]
    assert summary["ok"] and summary["train"]["steps"] == STEPS and 15 <= resumed < STEPS
    log0 = (run / "logs" / "rank00000.log").read_text()
    assert "received SIGUSR2" in log0 and f"preempted at step {resumed}" in log0 and "requeued job" in log0
    assert f"resumed from step {resumed}" in log0

    final = f"step_{STEPS:08d}"
    a = _datasets(only_run_dir(tmp_path / "base") / "checkpoints" / final)
    b = _datasets(run / "checkpoints" / final)
    assert a and a.keys() == b.keys()
    for key in a:
        assert np.array_equal(a[key], b[key]), key
