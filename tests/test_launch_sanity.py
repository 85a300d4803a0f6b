"""Launch sanity against what real sites do: the srun MPI plugin checked against the site's own list, threads per
rank from the affinity mask, and requeue() deciding from the job's state whether a signal was a preemption or a
user's scancel (and saying so when there is no scontrol).

    .venv/bin/python -m pytest tests/test_launch_sanity.py -q     # the slurm-marked tests need slurm/cluster.sh up

The real-cluster cases use the local Slurm 22.05 cluster, no mocks: its `srun --mpi=list` offers none, pmi2,
pmix, cray_shasta and pmix_v4 (not pmix_v3).
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

from conftest import BIN, EXAMPLE, REPO, env_with_venv, only_run_dir
from hpctrain import launch, preempt
from hpctrain.checkpoint.manager import committed
from hpctrain.config import load_config

# `srun --mpi=list` of Slurm 22.05.8 (this project's cluster), verbatim
MPI_LIST_22_05 = """MPI plugin types are...
\tpmix
\tnone
\tcray_shasta
\tpmi2
specific pmix plugin versions available: pmix_v4
"""


def test_parse_mpi_list():
    assert launch.parse_mpi_list(MPI_LIST_22_05) == ["cray_shasta", "none", "pmi2", "pmix", "pmix_v4"]
    assert launch.parse_mpi_list("specific pmix plugin versions available: pmix_v3,pmix_v4\n") == \
        ["pmix_v3", "pmix_v4"]
    assert launch.parse_mpi_list("") == [] and launch.parse_mpi_list("srun: error: something\n") == []


def test_srun_line_has_the_chosen_plugin():
    text = launch.render_sbatch(load_config(EXAMPLE, ["job.mpi=pmix"]), "/RUNDIR/submitit", python="python3")
    (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
    assert " --mpi=pmix " in srun and "--mpi=pmi2" not in srun
    text = launch.render_sbatch(load_config(EXAMPLE, ["job.mpi=''"]), "/RUNDIR/submitit", python="python3")
    assert "--mpi" not in text  # "": the site's MpiDefault


@pytest.mark.slurm
@pytest.mark.faults
def test_plugin_missing_from_the_site_is_refused_before_sbatch(slurm_cluster):
    assert "pmi2" in launch.mpi_plugins()  # what the local cluster offers (measured: see MPI_LIST_22_05)
    launch.check_cluster(load_config(EXAMPLE))  # job.mpi = "pmi2": accepted
    with pytest.raises(ValueError) as info:
        launch.check_cluster(load_config(EXAMPLE, ["job.mpi=pmix_v3"]))
    msg = str(info.value)
    assert "job.mpi = 'pmix_v3'" in msg and "srun --mpi=list" in msg
    assert "pmi2" in msg and "pmix_v4" in msg  # the site's list, so the user can pick
    record("job.mpi names an srun MPI plugin the site lacks (pmix_v3 on a pmix_v4 site)",
           "refused before sbatch with the site's `srun --mpi=list` in the message", tier="slurm")


@pytest.mark.slurm
def test_listed_plugin_that_srun_cannot_load_warns(slurm_cluster):
    # measured here: pmix is listed, but `srun --mpi=pmix` fails with "pmi/pmix: can not load PMIx library"
    notes = []
    launch.check_cluster(load_config(EXAMPLE, ["job.mpi=pmix"]), notes.append)
    assert len(notes) == 1 and "job.mpi = 'pmix' is listed" in notes[0] and "can not load PMIx library" in notes[0]
    notes.clear()
    launch.check_cluster(load_config(EXAMPLE), notes.append)
    assert notes == []


# --- threads per rank from the affinity mask --------------------------------------------------------------

@pytest.mark.parametrize("host_cpus, mask, ranks, env, threads", [
    # Slurm binds each task to its own cpus_per_task CPUs (task/affinity): the whole mask is this rank's
    (128, range(12), 8, {"SLURM_CPUS_PER_TASK": "12"}, 12),
    # no binding (--cpu-bind=none, task/none): every rank sees the node's CPUs and shares them
    (128, range(128), 8, {}, 16),
    # ... capped at what was asked of Slurm (the rest of a shared node is other jobs')
    (128, range(128), 8, {"SLURM_CPUS_PER_TASK": "4"}, 4),
    # a job cpuset (cgroup) without per-task binding: 16 CPUs shared by the 8 ranks of a 2-CPU-per-task job
    (128, range(16), 8, {"SLURM_CPUS_PER_TASK": "2"}, 2),
    # a step cpuset of 96 CPUs shared by 8 ranks
    (128, range(96), 8, {"SLURM_CPUS_PER_TASK": "12"}, 12),
    # mpiexec -n 4 on this 2-core machine: never 0
    (2, range(2), 4, {}, 1),
    # a container limited to 4 of the host's 64 CPUs, one rank: 4, not 64
    (64, range(4), 1, {}, 4),
    # OMP_NUM_THREADS wins
    (128, range(12), 8, {"OMP_NUM_THREADS": "3", "SLURM_CPUS_PER_TASK": "12"}, 3),
])
def test_cpu_threads_from_the_affinity_mask(monkeypatch, host_cpus, mask, ranks, env, threads):
    from hpctrain import session

    for var in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(session.os, "cpu_count", lambda: host_cpus)
    monkeypatch.setattr(session.os, "sched_getaffinity", lambda pid: set(mask))
    assert session.cpu_threads(ranks) == threads


# --- requeue(): preemption or a user's scancel ------------------------------------------------------------

@pytest.mark.parametrize("state, reason, requeued", [
    ("RUNNING", "None", True),         # preemption GraceTime, scancel --signal=USR2, the USR2@N time warning
    ("COMPLETING", "None", False),     # a plain scancel (measured: COMPLETING before the tasks get SIGTERM)
    ("COMPLETING", "TimeLimit", False),  # the time limit itself
])
def test_requeue_decides_from_the_job_state(monkeypatch, tmp_path, state, reason, requeued):
    """The decision alone, with a stand-in scontrol printing what Slurm 22.05 printed in each case (the real
    thing: tests/test_slurm.py::test_scancel_saves_and_is_not_requeued)."""
    calls = tmp_path / "calls"
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n"
                    f"[ \"$1\" = show ] && echo 'JobId=4242 JobName=x JobState={state} Reason={reason} Restarts=0'\n"
                    "exit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    msg = preempt.requeue()
    asked = calls.read_text().splitlines()
    if requeued:
        assert msg == "requeued job 4242" and asked == ["show job -o 4242", "requeue 4242"]
    else:
        assert msg.startswith("job 4242 not requeued") and f"JobState={state} Reason={reason}" in msg
        assert asked == ["show job -o 4242"]


# --- requeue() in a container without scontrol ------------------------------------------------------------

@pytest.mark.faults
def test_requeue_without_scontrol_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no scontrol
    msg = preempt.requeue()
    assert "job 4242 not requeued" in msg and "no scontrol on PATH" in msg and "resume" in msg
    record("preemption requeue with no scontrol on PATH (a container without the Slurm client)",
           "one line says the job was not requeued and how to resume; no exception", tier="pure")


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
