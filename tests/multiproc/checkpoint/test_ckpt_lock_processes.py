"""Checkpoint directory locks held by real processes: a killed holder taken over, racing takeovers with one winner
(the lock itself: tests/pure/checkpoint/test_ckpt_lock.py).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/checkpoint/test_ckpt_lock_processes.py
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faults import record

from helpers.launch import REPO
from helpers.locks import HOST, dead_pid, write_lock
from hpctrain.checkpoint.lock import NAME, CheckpointDirLocked, acquire

CHILD = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("lock", sys.argv[1])  # the file alone: no torch to import
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)
lock.acquire(sys.argv[2])
print("held", flush=True)
time.sleep(120)
"""


@pytest.mark.faults
def test_second_job_refused_then_takes_over_a_killed_holder(tmp_path) -> None:
    root = tmp_path / "ckpt"
    env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="0")
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(REPO / "hpctrain/checkpoint/lock.py"), str(root)],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointDirLocked) as e:
            acquire(root, {"job_id": "4243"})
        msg = str(e.value)
        for part in (str(root), "in use by job 4242", f"host {HOST}", f"pid {child.pid}", "started 20",
                     "set checkpoint.dir to another directory"):
            assert part in msg, msg
        assert "remove" not in msg  # a live holder: no advice to delete its lock
    finally:
        child.kill()
        child.wait()
    t0 = time.monotonic()
    with acquire(root, {"job_id": "4243"}) as lk:  # same host, its pid is gone
        assert json.loads(lk.path.read_text())["job_id"] == "4243"
    assert [p.name for p in root.iterdir()] == []  # no .stale- file left behind
    record("second job on a checkpoint directory held by a live job; then the holder is kill -9'd",
           "second job refused naming job, host, pid, start; after the kill it takes the lock over",
           seconds=time.monotonic() - t0, tier="unit")


def _race(root: str, rounds: int, start, done, results) -> None:
    for i in range(rounds):
        start.wait()
        try:
            lk = acquire(Path(root))
            results.put((i, os.getpid(), "won", lk.path.read_bytes()))
        except CheckpointDirLocked as e:
            results.put((i, os.getpid(), "refused", str(e).encode()))
        except Exception as e:  # reported to the parent, which fails the test
            results.put((i, os.getpid(), repr(e), b""))
        done.wait()


@pytest.mark.faults
def test_racing_takeovers_have_one_winner(tmp_path) -> None:
    num_procs, rounds = 4, 25
    ctx = mp.get_context("fork")
    start, done, results = ctx.Barrier(num_procs + 1), ctx.Barrier(num_procs + 1), ctx.Queue()
    stale = write_lock(tmp_path, pid=dead_pid())
    procs = [ctx.Process(target=_race, args=(str(tmp_path), rounds, start, done, results))
             for _ in range(num_procs)]
    for p in procs:
        p.start()
    try:
        for i in range(rounds):
            (tmp_path / NAME).write_bytes(stale)
            start.wait(timeout=30)
            got = [results.get(timeout=30) for _ in range(num_procs)]
            winners = [g for g in got if g[2] == "won"]
            assert len(winners) == 1 and all(g[2] in ("won", "refused") for g in got), (i, got)
            assert (tmp_path / NAME).read_bytes() == winners[0][3]  # the winner's record, not a loser's
            assert [p.name for p in tmp_path.iterdir()] == [NAME]  # nothing left aside
            done.wait(timeout=30)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    record(f"{num_procs} processes race to take over one stale lock ({rounds} rounds)",
           "exactly one wins each round; LOCK.json holds the winner's record; no stale file left", tier="unit")
