"""Submission without Slurm: submitit's local executor runs every rank on this host (file rendezvous)."""
from __future__ import annotations

import json

from helpers.launch import EXAMPLE, hpctrain
from helpers.runs import only_run_dir, read_summary


def test_local_executor_completes(tmp_path) -> None:
    out = hpctrain("submit", str(EXAMPLE), "--wait", "--set", "job.executor=local", "--set", "train.steps=0",
                   "--set", f"job.run_root={tmp_path}", timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "executor: local" in out.stdout and "run as 4 processes on this host" in out.stdout
    s = read_summary(tmp_path)
    assert s["ok"] and s["launcher"] == "submitit" and s["world_size"] == 4 and s["num_nodes"] == 1
    assert s["checks"]["groups"]["tp"] == [[0, 1], [2, 3]]
    run_dir = only_run_dir(tmp_path)
    job = json.loads((run_dir / "job.json").read_text())
    assert job["executor"] == "local" and job["job_id"] == s["job_id"]
    assert (run_dir / "config.toml").read_text().startswith("[job]")
    assert not list(run_dir.glob("rendezvous-*"))  # the store's address file is removed once all ranks joined
    assert "all-reduce checks passed" in out.stdout  # --wait echoes rank 0's log


def test_local_failure_exits_nonzero(tmp_path) -> None:
    # Forcing Slurm rendezvous under the local executor fails on every rank at start: --wait must report it.
    out = hpctrain("submit", str(EXAMPLE), "--wait", "--set", "job.executor=local", "--set", "job.nodes=1",
                   "--set", "parallel.rendezvous=slurm", "--set", f"job.run_root={tmp_path}", timeout=240)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "failed" in out.stderr and "launcher 'slurm' detected but SLURM_PROCID" in out.stderr
