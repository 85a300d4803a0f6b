"""Hangs and stragglers under mpiexec and on the local Slurm cluster (issue 17).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/cluster/hang/test_hang.py

A rank stopped (SIGSTOP, from the SEAM_FAULT test seam inside a step's forward) or asleep inside a step: every
rank is gone within parallel.hang_timeout_s plus a margin, every live rank left its stacks and flight recorder in
hang/, and `hpctrain diagnose` names the culprit and its node. On Slurm `submit --wait` exits 1 with the hang
and a slowed rank is named as the straggler with its node. The local-executor case is
tests/multiproc/hang/test_hang_local.py.
"""
from __future__ import annotations

import json
import re
import subprocess

import pytest
from faults import record
from launches import GONE_MARGIN_S, HANG_S, HANG_SETS, STRAGGLER_SETS, Launch, check_hang, hang_run, mpi_train, sets

from helpers.launch import EXAMPLE, env_with_venv, seam_env, tool
from helpers.runs import only_run_dir, read_summary
from hpctrain.hang import diagnose

pytestmark = pytest.mark.faults


@pytest.mark.mpi
@pytest.mark.parametrize("action", ["SIGSTOP", "sleep600"])
def test_hung_rank_mpiexec(mpiexec, tmp_path, action) -> None:
    """mpiexec -n 4 (tp=2 x dp=2): rank 3 stops, or sleeps, in step 3's forward."""
    root = tmp_path / "runs"
    launch = Launch(mpi_train(root, 4, *HANG_SETS), seam_env(SEAM_FAULT=f"{action}:3:forward3"))
    stopped = action == "SIGSTOP"
    gone, _ = hang_run(launch, b"PMI_RANK", root, 4, culprit=3, stopped=stopped)
    assert gone is not None and gone < HANG_S + GONE_MARGIN_S, (gone, launch.output[-3000:])
    assert launch.proc.returncode != 0 and "MPI_Abort" in launch.output, launch.output[-3000:]
    report = check_hang(root, 4, culprit=3)
    culprit = report["culprits"][0]
    assert (culprit["step"], culprit["phase"], culprit["dumped"]) == (3, "forward", not stopped), culprit
    if not stopped:  # asleep: its own stack says where
        assert any("busy in forward of step 3" in line and "inject_fault" in line for line in report["lines"]), \
            report["lines"]
    record(f"rank 3 {'stopped (SIGSTOP)' if stopped else 'asleep'} inside step 3's forward (mpiexec -n 4, tp=2 x "
           f"dp=2)", f"the watchdog ({HANG_S} s) dumps every live rank, MPI_Abort ends all; diagnose names rank 3",
           gone, "mpi")


@pytest.mark.slurm
def test_hung_rank_slurm_requeued_without_its_node(slurm_cluster, tmp_path) -> None:
    """2 nodes x 2 tasks on the 3-node cluster: rank 2 (the first rank of n2) stops in its first step's forward.
    That step has the long limit (300 s here), but a stopped rank's watchdog falls silent: its neighbour calls the
    hang at the step limit (issue 25: the second stop took the whole long limit). The job is requeued without n2
    (job.node_requeues = 1) and runs again on n1 and n3, where rank 2 stops again in its first step: that hang ends
    the job (the limit), well within the long limit, and submit --wait exits 1. Both hangs are named, each with its
    node. (Slurm wakes the stopped rank with SIGCONT at the requeue: its late dump must not count.)"""
    root = tmp_path / "runs"
    long_s = 300
    launch = Launch([tool("hpctrain"), "submit", str(EXAMPLE), "--wait",
                     *sets(f"job.run_root={root}", "job.wait_timeout_s=30", *HANG_SETS,
                           f"parallel.startup_timeout_s={long_s}", "job.node_requeues=1")],
                    seam_env(SEAM_FAULT="SIGSTOP:2:forward"))
    launch.wait_for(r"submitted job \d+", 60)
    job_id = re.search(r"submitted job (\d+)", launch.output).group(1)
    gone, _ = hang_run(launch, b"SLURM_PROCID", root, 4, culprit=2, stopped=True, cancel=["scancel", job_id],
                       finish_s=240)
    assert gone is not None and gone < HANG_S + GONE_MARGIN_S, (gone, launch.output[-3000:])
    assert launch.proc.returncode == 1 and "hang on rank" in launch.output, launch.output[-3000:]
    run = only_run_dir(root)
    history = [json.loads(line) for line in (run / "requeues.jsonl").read_text().splitlines()]
    assert [h["requeued"] for h in history] == [True, False] and history[0]["nodes"] == ["n2"], history
    assert "ExcNodeList=n2" in history[0]["why"] and "job.node_requeues = 1" in history[1]["why"], history
    assert {h["cause"] for h in history} == {"hang"}, history
    (earlier,) = run.glob("hang-*")  # the first hang's files and heartbeats, moved aside by the second incarnation
    first = subprocess.run([tool("hpctrain"), "diagnose", str(earlier), "--json"], capture_output=True, text=True,
                           timeout=60, env=env_with_venv())
    culprits = json.loads(first.stdout)["culprits"]
    assert [(c["rank"], c["node"], c["dumped"]) for c in culprits] == [(2, "n2", False)], first.stdout
    check_hang(root, 4, culprit=2, node="n3")  # the second hang: n2 was excluded
    # where the others were: n1 and n3 (their dumps say; whether ranks 0 and 1 already waited in a collective when
    # the hang was called depends on the load: CI-33 found them still in their first backward, DTensor's first-step
    # sharding propagation holding their GIL)
    nodes = {r: diagnose.parse_dump((run / "hang" / f"rank{r:05d}.txt").read_text())[0]["node"] for r in (0, 1, 3)}
    assert nodes == {0: "n1", 1: "n1", 3: "n3"}, nodes
    record("rank 2 stopped (SIGSTOP) inside its first step's forward, twice (Slurm, 2 nodes x 2 tasks, 3 nodes)",
           f"a neighbour's watchdog sees rank 2's silent at the step limit ({HANG_S} s; the first step's long limit "
           f"is {long_s} s) and ranks 0, 1, 3 dump; the job is requeued without n2 and runs again on n1, n3; the "
           "second hang ends it (job.node_requeues = 1) within the launcher's 240 s; submit --wait exits 1; "
           "diagnose names rank 2 on n2, then on n3", gone, "slurm")


@pytest.mark.slurm
@pytest.mark.alone  # judges compute times measured on this shared host
def test_straggler_named_with_its_node_slurm(slurm_cluster, tmp_path) -> None:
    """Rank 3 (on n2) sleeps 0.3 s in every step; dp=4 across 2 nodes: the report names rank 3 and n2."""

    out = subprocess.run([tool("hpctrain"), "submit", str(EXAMPLE), "--wait",
                          *sets(f"job.run_root={tmp_path}", "train.steps=9", "train.log_every=3",
                                "checkpoint.at_end=false", "data.source=synthetic", "model.n_layers=1",
                                "model.dim=64", "parallel.tp=1", *STRAGGLER_SETS)],
                         capture_output=True, text=True, timeout=400,
                         env=env_with_venv() | seam_env(SEAM_FAULT="sleep0.3:3:forward"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = read_summary(tmp_path)["train"]["stragglers"]
    assert [r["rank"] for r in summary["ranks"]] == [3] and summary["hosts"][0]["host"] == "n2", summary
    last = json.loads((only_run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["stragglers"][0]["host"] == "n2", last
    assert "| slow: rank 3 (n2)" in out.stdout, out.stdout[-2000:]
    # the job crawled but did not hang: diagnose names the slow rank and its node from the run's report
    seen = subprocess.run([tool("hpctrain"), "diagnose", str(only_run_dir(tmp_path))], capture_output=True,
                          text=True, timeout=60, env=env_with_venv())
    assert seen.returncode == 0 and seen.stdout.startswith("finished"), seen.stdout + seen.stderr
    assert re.search(r"^stragglers over 4 log intervals to step 9: rank 3 \(n2\) slow in [34] \(worst \+\d+%\); "
                     r"hosts: n2 \([34]\)$", seen.stdout, re.MULTILINE), seen.stdout  # steps 1, 3, 6, 9
