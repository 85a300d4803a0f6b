"""`hpctrain doctor` through the real launchers, and the training preflight on the local Slurm cluster.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/cluster/doctor/test_doctor_system.py

mpiexec (two named nodes of 2 ranks) and Slurm (`hpctrain doctor CONFIG`: submitted, waited for, the table
printed): a healthy run exits 0, a node measuring 100x slower by the test seam (SEAM_DOCTOR_SLOW and tests/plugins
on PYTHONPATH, passed to the tasks through sbatch's environment; tests/plugins/seams.py) exits 1 with its --exclude=
line. A training job with job.preflight = true and a slowed node is requeued without it (the local cluster has 3
nodes) and trains on the two others. They run beside other tests: each doctor fails a value only below 0.05 x its
peers' median (--margin and --storage-margin 0.95, job.preflight_margin = 0.95), which the seam's factor 100
crosses and a neighbour's load on this host's two cores does not (it moves rates by a few times).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from faults import record

from helpers.launch import EXAMPLE, PLUGINS, hpctrain, required, run_mpiexec, seam_env
from helpers.runs import only_run_dir

WIDE = ["--margin", "0.95", "--storage-margin", "0.95"]  # fail only below 0.05 x the median (module docstring)
SLOW = "100"  # the seam's factor


def _doctor(root, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hpctrain.cli", "doctor", str(EXAMPLE), "--here", "--set",
            f"job.run_root={root}", "--storage-mb", "32", *WIDE, *extra]


@pytest.mark.mpi
@pytest.mark.faults
def test_doctor_under_mpiexec_flags_the_slowed_node(mpiexec, tmp_path) -> None:
    for slow in ("", "b"):
        root = tmp_path / (slow or "healthy")
        cmd = _doctor(root)
        t0 = time.monotonic()
        seam = ["-env", "PYTHONPATH", str(PLUGINS), "-env", "SEAM_DOCTOR_SLOW", f"{slow}:{SLOW}" if slow else ""]
        out = run_mpiexec(mpiexec, ["-n", "2", "-env", "SLURMD_NODENAME", "a", *seam] + cmd,
                          ["-n", "2", "-env", "SLURMD_NODENAME", "b", *seam] + cmd)
        seconds = time.monotonic() - t0
        report = json.loads((only_run_dir(root) / "doctor.json").read_text())
        if not slow:
            assert out.returncode == 0 and "PASSED: every check is within bounds" in out.stdout, out.stdout[-3000:]
            assert report["ok"] and [n["node"] for n in report["nodes"]] == ["a", "b"]
            assert report["nodes"][0]["env"]["mpi"].startswith("MPICH")  # the launch's MPI library is named
            continue
        assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
        assert "FAILED nodes: b" in out.stdout and "exclude them: --exclude=b" in out.stdout
        assert report["failed_nodes"] == ["b"]
        record("a node measuring 100x slower (SEAM_DOCTOR_SLOW) under mpiexec, 2 named nodes x 2 ranks",
               "hpctrain doctor --here exits 1 naming it, with --exclude=b", seconds, "mpi")


def _when_idle(timeout_s: float = 300) -> None:
    """The cluster is shared: wait until no job runs, so that a 2-node job starts on n1 and n2."""
    t0 = time.monotonic()
    while subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=20).stdout.strip():
        assert time.monotonic() - t0 < timeout_s, "the cluster never became idle"
        time.sleep(2)


@pytest.mark.slurm
@pytest.mark.faults
def test_doctor_submitted_to_slurm(slurm_cluster, tmp_path, monkeypatch) -> None:
    _when_idle()
    out = hpctrain("doctor", str(EXAMPLE), *WIDE, "--set", f"job.run_root={tmp_path / 'healthy'}", timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "executor: slurm" in out.stdout and "PASSED: every check is within bounds" in out.stdout
    report = json.loads((only_run_dir(tmp_path / "healthy") / "doctor.json").read_text())
    assert [n["node"] for n in report["nodes"]] == ["n1", "n2"] and report["job"]["launcher"] == "mpi"
    # set by hpctrain for the mpich wheel before MPI starts (rendezvous.mpi_environment): the summary shows it
    assert "MPIR_CVAR_CH4_NETMOD=ofi" in out.stdout
    _when_idle()
    for var, value in seam_env(SEAM_DOCTOR_SLOW=f"n2:{SLOW}").items():  # through sbatch's environment to the tasks
        monkeypatch.setenv(var, value)
    t0 = time.monotonic()
    out = hpctrain("doctor", str(EXAMPLE), "--json", *WIDE, "--set", f"job.run_root={tmp_path / 'slowed'}",
                   timeout=400)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)  # --json: only the report on stdout, the job's progress on stderr
    assert report["failed_nodes"] == ["n2"] and report["exclude"] == "--exclude=n2"
    record("a node measuring 100x slower (SEAM_DOCTOR_SLOW) in a 2-node Slurm job", "hpctrain doctor exits 1 with "
           "--exclude=n2 (JSON with --json)", time.monotonic() - t0, "slurm")


@pytest.mark.slurm
@pytest.mark.faults
def test_preflight_requeues_without_the_slowed_node(slurm_cluster, tmp_path, monkeypatch) -> None:
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=20).stdout.split()
    if len(set(nodes)) < 3:  # a 2-node job needs a third node to move to
        why = f"the local cluster has {len(set(nodes))} node(s); this test needs 3 (slurm/cluster.sh up, the default)"
        pytest.fail(why) if required("HPCTRAIN_REQUIRE_SLURM") else pytest.skip(why)
    _when_idle()
    for var, value in seam_env(SEAM_DOCTOR_SLOW=f"n1:{SLOW}").items():
        monkeypatch.setenv(var, value)
    t0 = time.monotonic()
    out = hpctrain("submit", str(EXAMPLE), "--wait", "--set", f"job.run_root={tmp_path}", "--set",
                   "job.preflight=true", "--set", "job.preflight_margin=0.95", "--set", "train.steps=4", "--set",
                   "train.log_every=2", timeout=600)
    seconds = time.monotonic() - t0
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    history = [json.loads(line) for line in (run_dir / "requeues.jsonl").read_text().splitlines()]
    assert len(history) == 1 and history[0]["requeued"] and history[0]["failed_nodes"] == ["n1"], history
    assert history[0]["cause"] == "preflight", history
    assert "ExcNodeList=n1" in history[0]["why"]
    summary = json.loads((run_dir / "summary.json").read_text())  # the second attempt's
    assert summary["doctor"]["ok"] and summary["train"]["steps"] == 4
    assert {r["node"] for r in summary["rank_map"]} == {"n2", "n3"}
    assert "preflight | FAILED nodes: n1" in out.stdout and "preflight | PASSED" in out.stdout
    record("job.preflight with a node measuring 100x slower, 2-node Slurm job on a 3-node cluster",
           "requeued without it (ExcNodeList=n1), runs again on n2, n3 and trains; requeues.jsonl says what was "
           "excluded and why", seconds, "slurm")
