"""Open files at scale, on CPU: a job under a login node's low soft `nofile` limit, the sockets its ranks hold, and
the dry run's count against the limit.

Stand-ins (set by the test in each process it starts, preexec_fn): Slurm hands tasks the soft limit of the shell
that submitted (often 1024 on a login node) while the compute node's hard limit is higher; here soft SOFT, hard
HARD. At 4 ranks rank 0 holds about 45 descriptors, so a rank that kept SOFT would fail with "Too many open files".

  1. a 4-rank training job (pp 1, dp 2, tp 2, asynchronous saves configured, none taken before the end) starts,
     every rank raises its soft limit to the hard one and says so in its log; each rank's established TCP
     connections, counted from /proc/self/fd, stay below what gloo's full mesh held (one per peer per group:
     the world, dp, tp and the async-save group), and its descriptors stay within planner/fds.py's bound;
  2. `hpctrain submit --dry-run` under a stand-in hard limit one below what fds.py counts for rank 0 refuses the
     layout naming both numbers; at exactly that count it passes.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/job/test_open_files.py
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import pytest

from helpers.launch import EXAMPLE, REPO, WORKERS, env_with_venv, tool

pytestmark = pytest.mark.faults

SOFT, HARD = 40, 4096
WORLD = 4
OVERRIDES = ["parallel.tp=2", "checkpoint.async_save=true", "checkpoint.every_steps=100"]


def _nofile(soft: int, hard: int):
    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return set_limit


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("nofile")
    procs = []
    for rank in range(WORLD):
        env = env_with_venv() | {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(WORLD), "SLURM_LOCALID": str(rank),
                                 "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_ID": f"nofile{os.getpid()}",
                                 "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, str(WORKERS / "open_files_worker.py"), str(out), *OVERRIDES,
               f"checkpoint.dir={out / 'ck'}"]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, preexec_fn=_nofile(SOFT, HARD)))
    t0 = time.monotonic()
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0] * WORLD, "\n".join(log[-3000:] for log in logs)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {"ranks": ranks, "seconds": time.monotonic() - t0}


def test_job_under_a_low_soft_limit_raises_it_and_says_so(job):
    from pathlib import Path

    from faults import record

    from hpctrain.job.runs import rank_log_path

    for rank, r in enumerate(job["ranks"]):
        assert r["soft_at_start"] == SOFT, r  # the stand-in reached the rank
        assert r["limits"] == [HARD, HARD], r
        log = rank_log_path(Path(r["run_dir"]), rank).read_text()
        assert f"soft limit on open files raised from {SOFT} to the hard limit {HARD}" in log, log[-2000:]
    summary = json.loads((Path(job["ranks"][0]["run_dir"]) / "summary.json").read_text())
    assert summary["open_files"] == {"soft_was": SOFT, "soft": HARD, "hard": HARD}, summary["open_files"]
    record(f"4-rank training job started under a login node's soft nofile limit ({SOFT}, hard {HARD})",
           f"every rank raises its soft limit to {HARD} before the rendezvous, logs it, "
           "summary.json keeps it, and the job trains and saves", job["seconds"], "multi-process")


def full_mesh(rank: int, tp: int, dp: int, pp: int, async_save: bool) -> int:
    """Established TCP connections of a rank when every gloo group connects every pair at creation (torch's
    default): one per peer per group, plus the rendezvous store (rank 0 serves every rank's client, its own too),
    twice: each rank's hang watchdog holds a store client of its own."""
    store = 2 * (WORLD + 1 if rank == 0 else 1)
    groups = [WORLD] + [n for n in (pp, dp, tp) if n != WORLD] + ([WORLD] if async_save else [])
    return store + sum(n - 1 for n in groups)


def test_ranks_hold_fewer_sockets_than_gloos_full_mesh(job):
    from faults import record

    from hpctrain.planner import fds

    for rank, r in enumerate(job["ranks"]):
        lay = r["layout"]
        assert lay == {"pp": 1, "dp": 2, "tp": 2}, lay
        eager = full_mesh(rank, lay["tp"], lay["dp"], lay["pp"], async_save=True)
        got = r["counts"]
        # the async-save group has not saved yet: lazily it holds no connection, eagerly one per peer
        assert got["tcp_established"] <= eager - (WORLD - 1), (rank, got, eager)
        bound = fds.estimate(fds.Job(WORLD, WORLD, lay["pp"], lay["dp"], lay["tp"], async_save=True)).total(rank)
        assert got["total"] <= bound, (rank, got, bound)
    record("4-rank CPU job (pp 1, dp 2, tp 2) with asynchronous saves configured: established TCP sockets per rank "
           "counted from /proc/self/fd", "each rank holds at most gloo's full-mesh count less the async-save "
           "group's 3 peers (lazy gloo connections), and no rank passes planner/fds.py's bound", None, "multi-process")


def _dry_run(hard: int) -> subprocess.CompletedProcess:
    cmd = [tool("hpctrain") or "hpctrain", "submit", str(EXAMPLE), "--dry-run"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env_with_venv(), cwd=REPO,
                          stdin=subprocess.DEVNULL, preexec_fn=_nofile(hard, hard))


def test_dry_run_refuses_a_layout_past_the_hard_limit():
    from faults import record

    from hpctrain.config import load_config
    from hpctrain.parallel.mesh import resolve_layout
    from hpctrain.planner import fds

    cfg = load_config(str(EXAMPLE), [])
    p = cfg.parallel
    need = fds.estimate(fds.job_of(cfg, resolve_layout(p.pp, p.dp, p.tp, cfg.world_size))).total(0)
    over = _dry_run(need - 1)
    assert over.returncode == 2, over.stdout + over.stderr
    assert f"may need {need} open files" in over.stderr and f"this host's hard limit {need - 1}" in over.stderr, \
        over.stderr
    assert "job.nofile" in over.stderr and "ulimit -Hn" in over.stderr, over.stderr
    ok = _dry_run(need)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"open files per rank (upper bounds, hpctrain/planner/fds.py): rank 0 {need}" in ok.stdout, ok.stdout
    record(f"submit --dry-run of the 4-rank example under a stand-in hard nofile limit of {need - 1} (job.nofile "
           f"unset)", f"exit 2 naming rank 0's {need} open files, the limit and the fixes (ulimit -Hn, job.nofile); "
           f"at {need} it passes and prints the table", None, "cli")
