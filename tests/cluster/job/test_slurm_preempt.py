"""Real Slurm, end to end: a 2-node job is preempted mid-run with `scancel --signal=USR2`, checkpoints on every
rank, requeues itself, resumes from its checkpoint and finishes; its final checkpoint equals an uninterrupted
job's, bit for bit, in every stored dataset whatever its dtype (same layout, CPU). A rank killed with SIGKILL in
the middle of a save leaves no committed checkpoint behind, and the next job resumes from the last committed one."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from faults import record

from helpers.ckpt_bytes import assert_bitwise_equal, stored_datasets
from helpers.launch import EXAMPLE, REPO, env_with_venv, hpctrain, tool
from helpers.runs import only_run_dir
from hpctrain.checkpoint.manager import committed

pytestmark = pytest.mark.slurm
STEPS = 60
SETS = ["--set", f"train.steps={STEPS}", "--set", "train.log_every=5", "--set", "model.n_layers=2"]


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
    # every dataset, whatever its dtype: weights and AdamW moments, the uint8 RNG table, the JSON hyperparameters
    assert_bitwise_equal(stored_datasets(only_run_dir(tmp_path / "base") / "checkpoints" / final),
                         stored_datasets(run / "checkpoints" / final))
    record("Slurm preemption signal (scancel --signal=USR2) mid-run", "checkpoint, requeue, resume; the final "
           "checkpoint bitwise equal to an uninterrupted job's", tier="slurm")


def _rank_pid(job_id: str, rank: int) -> int | None:
    """The pid of one task of a running job, found by its environment (we are root on the test host)."""
    for env_file in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = env_file.read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in env and f"SLURM_PROCID={rank}".encode() in env and \
                b"SUBMITIT_EXECUTOR=slurm" in env:
            cmdline = (env_file.parent / "cmdline").read_bytes()
            if b"submitit.core._submit" in cmdline:
                return int(env_file.parent.name)
    return None


def test_kill_9_during_save_resumes_from_last_committed(slurm_cluster, tmp_path) -> None:
    sets = ["--set", "train.steps=8", "--set", "train.log_every=1", "--set", "checkpoint.every_steps=3",
            "--set", "model.dim=256",
            "--set", "parallel.timeout_s=60", "--set", "job.wait_timeout_s=10"]
    cmd = [tool("hpctrain"), "submit", str(EXAMPLE), "--wait", *sets, "--set", f"job.run_root={tmp_path / 'a'}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_with_venv(),
                            cwd=REPO)
    job_id = None
    for line in proc.stdout:
        m = re.search(r"submitted job (\d+)", line)
        if m:
            job_id = m.group(1)
        if "step 1/8" in line:
            break
    run = only_run_dir(tmp_path / "a")
    victim = _rank_pid(job_id, 1)
    assert victim, "rank 1's process not found"
    partial = run / "checkpoints" / "step_00000006.partial"
    deadline = time.time() + 240
    while not partial.exists() and time.time() < deadline:
        time.sleep(0.002)
    assert partial.exists(), "the save of step 6 never started"
    os.kill(victim, signal.SIGKILL)  # in the middle of the save of step 6
    t0 = time.time()
    out, err = proc.communicate(timeout=300)
    gone = time.time() - t0
    assert proc.returncode == 1, out + err  # the job failed, and --wait said so
    assert [s for s, _ in committed(run / "checkpoints")] == [3]  # the killed save never counts

    again = hpctrain("submit", str(EXAMPLE), "--wait", *sets, "--set", f"job.run_root={tmp_path / 'b'}",
                     "--set", f"train.resume={run}", timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    summary = json.loads((only_run_dir(tmp_path / "b") / "summary.json").read_text())
    assert summary["ok"] and summary["train"]["resumed_from"] == 3 and summary["train"]["steps"] == 8
    record("SIGKILL of one rank in the middle of a save (Slurm, 2 nodes)", "the job fails (--wait exits 1); the "
           "killed save never counts; a new job resumes from the last committed step", gone, tier="slurm")
