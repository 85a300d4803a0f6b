"""Hangs and stragglers with local processes (issue 17): `hpctrain submit --wait` on submitit's local executor,
4 ranks on this host (tp=2 x dp=2), no MPI and no Slurm to end them.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/hang/test_hang_local.py

A rank stopped inside a step's forward (SIGSTOP, as a hung node), the third step's or the first's (which has the
long limit, 120 s here, for compiling: a stopped rank's silent watchdog ends that allowance): every rank is gone
within the hang limit plus a margin (the live ranks end themselves; the first to trip kills the stopped one, which
no launcher would), every live rank left its stacks and flight recorder, `submit --wait` exits 1 naming the hang,
and `hpctrain diagnose` names the stopped rank. A rank that sleeps in every step is named as the straggler, with
its host.
"""
from __future__ import annotations

import json
import subprocess

import pytest
from faults import record
from launches import GONE_MARGIN_S, HANG_S, HANG_SETS, STRAGGLER_SETS, Launch, check_hang, hang_run, sets

from helpers.launch import EXAMPLE, env_with_venv, seam_env, tool
from helpers.runs import only_run_dir, read_summary


@pytest.mark.parametrize("step", [3, 1])
def test_stopped_rank_local_processes(tmp_path, step) -> None:
    root = tmp_path / "runs"
    launch = Launch([tool("hpctrain"), "submit", str(EXAMPLE), "--wait",
                     *sets(f"job.run_root={root}", "job.executor=local", "job.wait_timeout_s=30", *HANG_SETS)],
                    seam_env(SEAM_FAULT=f"SIGSTOP:1:forward{step}"))
    gone, pids = hang_run(launch, b"SUBMITIT_LOCAL_GLOBALID", root, 4, culprit=1, stopped=True)
    assert gone is not None and gone < HANG_S + GONE_MARGIN_S, (gone, launch.output[-3000:])
    assert launch.proc.returncode == 1 and "hang on rank" in launch.output, launch.output[-3000:]
    report = check_hang(root, 4, culprit=1)
    # rank 1's tp peer waits for it inside the forward (the dp peers for the tp pair in the gradient reduction), or,
    # when rank 1 stopped before its gloo thread finished the previous step's flag agreement (train/agreement.py, an
    # asynchronous all-reduce of the world), in that one: the first collective rank 0 saw unfinished
    assert any(("rank 0 (" in line and "tp group" in line) or ("ranks 0" in line and "on the world" in line
               and line.endswith("for rank 1 (vm)")) for line in report["lines"]), report["lines"]
    assert report["waiting"]["0"]["for"] == [1], report["waiting"]
    if step == 3:
        record("SIGSTOP of rank 1 inside step 3's forward (local executor, 4 processes, tp=2 x dp=2)",
               f"the watchdog ({HANG_S} s) dumps ranks 0, 2, 3, kills the stopped rank; submit --wait exits 1; "
               "diagnose names rank 1", gone, "multiproc")
    else:
        record("SIGSTOP of rank 1 inside the first step's forward, whose long limit is 120 s (local executor, 4 "
               "processes, tp=2 x dp=2)", f"a neighbour sees its watchdog silent at the step limit ({HANG_S} s): "
               f"every rank gone within {HANG_S + GONE_MARGIN_S} s, dumps of ranks 0, 2, 3; submit --wait exits 1; "
               "diagnose names rank 1", gone, "multiproc")


@pytest.mark.alone  # judges compute times measured on this shared host
def test_slow_rank_is_named_a_straggler(tmp_path) -> None:
    """Rank 2 sleeps 0.3 s in every step's forward: it computes longest and its dp peers wait for it (dp=4; with
    tp=2 its tp peer would wait inside the forward and be named beside it, on the same host)."""
    out = subprocess.run([tool("hpctrain"), "submit", str(EXAMPLE), "--wait",
                          *sets(f"job.run_root={tmp_path}", "job.executor=local", "train.steps=12",
                                "train.log_every=4", "checkpoint.at_end=false", "data.source=synthetic",
                                "model.n_layers=1", "model.dim=64", "parallel.tp=1", *STRAGGLER_SETS)],
                         capture_output=True, text=True, timeout=300,
                         env=env_with_venv() | seam_env(SEAM_FAULT="sleep0.3:2:forward"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = read_summary(tmp_path)["train"]["stragglers"]
    assert summary["log_intervals"] == 4, summary  # steps 1, 4, 8, 12
    assert [r["rank"] for r in summary["ranks"]] == [2] and summary["ranks"][0]["intervals"] >= 3, summary
    rows = [json.loads(line) for line in (only_run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    compute, wait = last["rank_compute_s"], last["rank_wait_s"]
    assert compute[2] == max(compute) and wait[2] == min(wait), (compute, wait)
    assert [s["rank"] for s in last["stragglers"]][:1] == [2], last["stragglers"]
    assert "| slow: rank 2 (" in out.stdout, out.stdout[-2000:]
