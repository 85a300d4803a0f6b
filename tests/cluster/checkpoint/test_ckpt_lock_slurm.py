"""One writer per checkpoint directory, against the local Slurm cluster's own squeue: the lock of an ended job
(or of a job id Slurm never had) is taken over, the lock of a pending or running one is refused. The rest of the
lock's checks are tests/pure/checkpoint/test_ckpt_lock.py's.
    # cluster.sh up
    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/cluster/checkpoint/test_ckpt_lock_slurm.py
"""
from __future__ import annotations

import subprocess
import time

import pytest

from helpers.locks import write_lock
from hpctrain.checkpoint.lock import CheckpointDirLocked, acquire


@pytest.mark.slurm
def test_real_slurm_ended_and_running_jobs(slurm_cluster, tmp_path) -> None:
    def sbatch(cmd: str) -> str:
        return subprocess.run(["sbatch", "--parsable", "--output=/dev/null", "--wrap", cmd], capture_output=True,
                              text=True, check=True, timeout=20).stdout.strip().split(";")[0]
    done, running = sbatch("true"), sbatch("sleep 60")
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(["squeue", "-h", "-t", "all", "-o", "%T", "-j", done], capture_output=True,
                             text=True).stdout.strip() not in ("COMPLETED", ""):
            assert time.monotonic() < deadline, f"job {done} did not finish"
            time.sleep(0.5)
        for job_id in (done, "999999"):
            write_lock(tmp_path, host="elsewhere", job_id=job_id)
            acquire(tmp_path).release()
        write_lock(tmp_path, host="elsewhere", job_id=running)  # pending or running: live either way
        with pytest.raises(CheckpointDirLocked, match=f"in use by job {running} "):
            acquire(tmp_path)
    finally:
        subprocess.run(["scancel", running], timeout=20)
