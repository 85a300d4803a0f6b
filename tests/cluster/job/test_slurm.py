"""Real Slurm tier: `hpctrain submit` against the local cluster (slurm/cluster.sh up: 3 nodes, jobs of 2).

Skipped when no cluster answers, except in CI where HPCTRAIN_REQUIRE_SLURM=1 turns that into a failure.
"""
from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
from faults import record

from helpers.launch import EXAMPLE, REPO, env_with_venv, hpctrain, tool
from helpers.runs import only_run_dir, read_summary
from hpctrain.checkpoint.manager import committed

pytestmark = pytest.mark.slurm


def _queue_size() -> int:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=20)
    return len(out.stdout.split())


def test_submit_two_nodes_rank_map(slurm_cluster, tmp_path) -> None:
    out = hpctrain("submit", str(EXAMPLE), "--wait", "--set", f"job.run_root={tmp_path}", "--set", "train.steps=0",
                   timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "executor: slurm" in out.stdout
    s = read_summary(tmp_path)
    assert s["ok"] and s["launcher"] == "mpi" and s["world_size"] == 4 and s["num_nodes"] == 2
    # srun -N2 -n4 places ranks 0-1 on n1 and 2-3 on n2; tp stays inside each node
    assert [r["node"] for r in s["rank_map"]] == ["n1", "n1", "n2", "n2"]
    assert s["checks"]["groups"]["tp"] == [[0, 1], [2, 3]]
    assert "intra" not in s["checks"]["groups"]  # training builds no per-node groups; the node split is the rank map's
    run_dir = s["run_dir"]
    assert re.search(rf"submitted job {s['job_id']} \(slurm\); run directory {re.escape(run_dir)}", out.stdout)
    for name in ("config.toml", "job.json", "logs/rank00000.log", "logs/rank00003.log"):
        assert (tmp_path / run_dir.split("/")[-1] / name).exists(), name


def test_refusals_submit_nothing(slurm_cluster, tmp_path) -> None:
    before = _queue_size()
    spans = hpctrain("submit", str(EXAMPLE), "--set", "parallel.tp=4", "--set", f"job.run_root={tmp_path}")
    assert spans.returncode == 2 and "tp(4) does not divide the 2 ranks per node" in spans.stderr
    nopart = hpctrain("submit", str(EXAMPLE), "--set", "job.partition=gpu", "--set", f"job.run_root={tmp_path}")
    assert nopart.returncode == 2 and "job.partition = 'gpu' does not exist" in nopart.stderr
    assert "debug" in nopart.stderr
    # a job the cluster could never run would pend forever: refused up front
    have = len(subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N"], capture_output=True, text=True,
                              timeout=20).stdout.split())  # 3 by default (slurm/cluster.sh)
    toobig = hpctrain("submit", str(EXAMPLE), "--set", f"job.nodes={have + 1}", "--set", f"job.run_root={tmp_path}")
    assert toobig.returncode == 2, toobig.stdout + toobig.stderr
    assert f"job.nodes = {have + 1} but partition 'debug' has only {have} node(s)" in toobig.stderr
    # an MPI plugin this site's srun does not have (it lists pmix_v4, not pmix_v3): every task would fail to start
    nompi = hpctrain("submit", str(EXAMPLE), "--set", "job.mpi=pmix_v3", "--set", f"job.run_root={tmp_path}")
    assert nompi.returncode == 2 and "job.mpi = 'pmix_v3' is not an MPI plugin of this site" in nompi.stderr
    assert "pmi2" in nompi.stderr
    # sbatch itself refuses (unknown node feature): reported, run directory removed
    feature = hpctrain("submit", str(EXAMPLE), "--set", "job.constraint=nosuch", "--set", f"job.run_root={tmp_path}")
    assert feature.returncode == 1 and "submission failed, nothing was submitted" in feature.stderr
    assert "Invalid feature specification" in feature.stderr
    assert _queue_size() == before
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_wait_does_not_hang_on_a_killed_job(slurm_cluster, tmp_path) -> None:
    cmd = [tool("hpctrain"), "submit", str(EXAMPLE), "--wait", "--set", f"job.run_root={tmp_path}",
           "--set", "job.wait_timeout_s=5", "--set", "job.setup=['sleep 600']"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_with_venv(),
                            cwd=REPO)
    line = proc.stdout.readline()
    while line and "submitted job" not in line:
        line = proc.stdout.readline()
    job_id = re.search(r"submitted job (\d+)", line).group(1)
    time.sleep(3)
    subprocess.run(["scancel", job_id], check=True, timeout=20)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 1
    assert f"job {job_id} left the queue without a result" in err


def test_example_trains_on_two_nodes(slurm_cluster, tmp_path) -> None:
    """The `make submit` example, shortened: tp=2 inside n1 and n2, dp=2 across them, on the bundled corpus."""
    corpus = REPO / "data" / "corpus.bin"
    if not corpus.exists():
        pytest.fail("data/corpus.bin missing: `make test` builds it (hpctrain data build data/corpus.bin)")
    out = hpctrain("submit", str(EXAMPLE), "--wait", "--set", f"job.run_root={tmp_path}", "--set", "train.steps=30",
                   "--set", "train.log_every=10", timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    s = read_summary(tmp_path)
    assert s["ok"] and [r["node"] for r in s["rank_map"]] == ["n1", "n1", "n2", "n2"]
    assert s["train"]["steps"] == 30 and s["train"]["final"]["loss"] < s["train"]["first_loss"] - 1.0
    assert "step 30/30" in out.stdout  # --wait echoed rank 0's progress


def test_pipeline_across_nodes(slurm_cluster, tmp_path) -> None:
    """3D on the local cluster: tp=2 inside each node, pp=2 across n1 and n2 (1F1B over 4 micro-batches)."""
    out = hpctrain("submit", str(EXAMPLE), "--wait", "--set", f"job.run_root={tmp_path}", "--set", "parallel.pp=2",
                   "--set", "train.steps=20", "--set", "train.micro_batch_size=2", "--set", "train.grad_accum=4",
                   "--set", "train.log_every=10", timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    s = read_summary(tmp_path)
    assert s["ok"] and s["layout"] == {"pp": 2, "dp": 1, "tp": 2}
    stage_nodes = {(r["pp"], r["node"]) for r in s["rank_map"]}
    assert stage_nodes == {(0, "n1"), (1, "n2")}  # each stage on its own node, tp inside it
    assert s["checks"]["groups"]["pp"] == [[0, 2], [1, 3]] and s["checks"]["groups"]["tp"] == [[0, 1], [2, 3]]
    train = s["train"]
    assert train["steps"] == 20 and train["final"]["loss"] < train["first_loss"] - 0.5
    pipe = train["pipeline"]
    assert pipe["schedule"] == "1f1b" and [r["blocks"] for r in pipe["per_pp_rank"]] == [[0, 1], [2, 3]]
    assert all(0 < r["idle_fraction"] < 1 for r in pipe["per_pp_rank"])


@pytest.mark.faults
def test_scancel_saves_and_is_not_requeued(slurm_cluster, tmp_path) -> None:
    """A user's plain `scancel`: the tasks get SIGTERM (like a preemption), save, and the job is NOT requeued.

    Measured on this Slurm 22.05: scancel marks the job COMPLETING before its tasks get SIGTERM, and
    `scontrol requeue` of a COMPLETING job succeeds and restarts it; preemption and `scancel --signal` leave it
    RUNNING (see preempt.requeue)."""
    steps = 120
    cmd = [tool("hpctrain"), "submit", str(EXAMPLE), "--wait", "--set", f"job.run_root={tmp_path}",
           "--set", f"train.steps={steps}", "--set", "train.log_every=5", "--set", "model.n_layers=2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_with_venv(),
                            cwd=REPO)
    lines, job_id = [], None
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"submitted job (\d+)", line)
        job_id = job_id or (m and m.group(1))
        if re.search(r"step (1[5-9]|2\d)/", line):
            subprocess.run(["scancel", job_id], check=True, timeout=30)
            t0 = time.time()
            break
    after, err = proc.communicate(timeout=300)
    gone = time.time() - t0
    out = "".join(lines) + after
    assert proc.returncode == 0, out + err  # every task returned after its save: --wait reports the job done
    assert "PENDING" not in after, out + err  # --wait would follow a requeued job back through PENDING
    state = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=20)
    assert "JobState=CANCELLED" in state.stdout and "Restarts=0" in state.stdout, state.stdout + state.stderr

    run = only_run_dir(tmp_path)
    log0 = (run / "logs" / "rank00000.log").read_text()
    assert "received SIGTERM" in log0 and f"job {job_id} not requeued" in log0, log0[-3000:]
    assert "Traceback" not in log0
    summary = json.loads((run / "summary.json").read_text())
    stopped = summary["train"]["steps"]
    assert summary["train"]["preempted"] and 15 <= stopped < steps
    assert [s for s, _ in committed(run / "checkpoints")][-1] == stopped  # the step reached is saved
    record("plain scancel (SIGTERM to every task) of a running Slurm job", "every rank saves; the committed "
           "checkpoint holds the step reached; not requeued (CANCELLED, Restarts=0)", gone, tier="slurm")
