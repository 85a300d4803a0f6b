"""Launch sanity against what real sites do, in this process: the srun MPI plugin list parsed and put on the srun
line, threads per rank from the affinity mask, and requeue() deciding from the job's state whether a signal was a
preemption or a user's scancel (and saying so when there is no scontrol). The plugin checked against the local
cluster's own list is tests/cluster/job/test_launch_slurm.py's; a preempted training run without scontrol is
tests/multiproc/job/test_preempt_without_scontrol.py's.

    .venv/bin/python -m pytest tests/pure/job/test_launch_sanity.py -q
"""
from __future__ import annotations

import pytest
from faults import record

from helpers.launch import EXAMPLE
from hpctrain.config import load_config
from hpctrain.job import launch, preempt

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
    from hpctrain.job import session

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
    thing: tests/cluster/job/test_slurm.py::test_scancel_saves_and_is_not_requeued)."""
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
