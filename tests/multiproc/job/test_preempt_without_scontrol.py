"""A preempted training run in a container without the Slurm client: `hpctrain train` in its own process, with a
Slurm job id, no scontrol on PATH and USR2 mid-run, commits the checkpoint of the step reached and ends with exit
0 and one clear line. The requeue decision alone is tests/pure/job/test_launch_sanity.py's.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from faults import record

from helpers.launch import BIN, EXAMPLE, REPO, env_with_venv
from helpers.runs import only_run_dir
from hpctrain.checkpoint.manager import committed


@pytest.mark.faults
def test_preempted_training_without_scontrol_saves_and_logs(tmp_path):
    """End to end in one process: a Slurm job id, no scontrol on PATH, USR2 mid-run. The checkpoint of the step
    reached is committed, the run ends with exit 0 and one clear line instead of a FileNotFoundError traceback."""
    env = {k: v for k, v in env_with_venv().items() if not k.startswith(("SLURM_", "PMI_", "OMPI_", "HPCTRAIN_"))}
    env |= {"PATH": str(BIN), "SLURM_JOB_ID": "4242"}  # the venv's bin holds python, not scontrol
    assert not (BIN / "scontrol").exists()
    cmd = [sys.executable, "-m", "hpctrain.cli", "train", str(EXAMPLE)]
    for s in (f"job.run_root={tmp_path}", "parallel.rendezvous=single", "parallel.tp=1", "data.source=synthetic",
              "model.n_layers=1", "model.dim=64", "train.steps=100000", "train.log_every=1",
              "checkpoint.at_end=false"):
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.search(r"step 3/", line):
                os.kill(proc.pid, signal.SIGUSR2)
                break
        lines.append(proc.communicate(timeout=120)[0])
    finally:
        proc.kill()
    out = "".join(lines)
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "job 4242 not requeued: no scontrol on PATH" in out, out[-3000:]
    run = only_run_dir(tmp_path)
    train = json.loads((run / "summary.json").read_text())["train"]
    assert train["preempted"] and [s for s, _ in committed(run / "checkpoints")] == [train["steps"]]
    record("preemption (USR2) of a training run with no scontrol on PATH",
           "checkpoint of the step reached committed; exit 0; one log line says not requeued; no traceback",
           tier="system")
