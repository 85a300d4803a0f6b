"""A submitted task takes USR2 and TERM from its first moment (hpctrain/entry.py's task runner, the python command
launch.py gives submitit): a signal while submitit loads the task is kept for the task, not fatal.

    pytest tests/multiproc/job/test_entry_task.py
"""
from __future__ import annotations

import os
import pickle
import shlex
import signal
import subprocess
import time

import pytest
import submitit
from faults import record

from helpers.launch import REPO
from hpctrain.job import launch

WORKERS = REPO / "tests" / "workers"


@pytest.mark.faults
def test_a_signal_while_submitit_loads_the_task_is_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(WORKERS))
    from signal_report import report  # pickled by reference: the task finds it on its PYTHONPATH
    folder = tmp_path / "submitit"
    folder.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env |= {"PYTHONPATH": str(WORKERS), "SUBMITIT_LOCAL_JOB_ID": "77", "SUBMITIT_LOCAL_NTASKS": "1",
            "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_GLOBALID": "0",
            "SUBMITIT_LOCAL_LOCALID": "0", "SUBMITIT_EXECUTOR": "local"}
    command = f"{launch.task_python()} -u -m submitit.core._submit {folder}"  # as submitit starts a task
    proc = subprocess.Popen(shlex.split(command), env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # submitit logs this, then waits (polling each second) for the task's pickle
            if "Loading pickle" in line:
                break
        proc.send_signal(signal.SIGUSR2)  # the job is preempted while its task starts
        time.sleep(0.5)
        submitit.core.utils.DelayedSubmission(report).dump(folder / "77_submitted.pkl")
        rest = proc.stdout.read()
        assert proc.wait(timeout=120) == 0, f"the task died (status {proc.returncode}):\n{rest}"
    finally:
        proc.kill()
    with open(folder / "77_0_result.pkl", "rb") as f:  # our own test's pickle, written by submitit
        outcome, result = pickle.load(f)
    assert outcome == "success", result
    assert result == {"received": signal.SIGUSR2, "usr2_is_ours": True}, result
    record("USR2 to a submitted task while submitit loads it (before the task's code runs)", "kept by the "
           "process's preemption flag for the task (a preemption at its first poll); submitit's handlers never "
           "installed; the task runs", tier="unit")
