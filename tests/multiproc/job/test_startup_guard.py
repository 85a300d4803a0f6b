"""A rank stuck before the hang watchdog runs (in MPI's start, or an MPI exchange of the rendezvous: neither has a
timeout of its own) prints every thread's stack and exits 1 after the watchdog's long limit, which ends the launch,
instead of holding the job until its time limit. Here a real process whose identify() never returns (a stand-in
for MPI_Init waiting on a peer) and parallel.startup_timeout_s = 2; and a healthy start of one process, which must
not be cut down later by the same timer (cancelled once the watchdog runs).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/job/test_startup_guard.py
"""
from __future__ import annotations

import subprocess
import sys
import time

from helpers.launch import REPO, env_with_venv

STUCK = """
import time
from hpctrain.config import load_config
from hpctrain.job import rendezvous, session
rendezvous.identify = lambda *args: time.sleep(120)  # never returns within the test
cfg = load_config(None, ["parallel.startup_timeout_s=2", "parallel.hang_timeout_s=1",
                         "job.run_root={root}"])
with session.start(cfg):
    pass
"""

HEALTHY = """
import time
from hpctrain.config import load_config
from hpctrain.job import session
cfg = load_config(None, ["parallel.startup_timeout_s=2", "parallel.hang_timeout_s=1", "job.run_root={root}"])
with session.start(cfg) as s:
    for _ in range(10):  # 5 s, past the start-up limit, progressing: the watchdog (not the timer) is in charge
        s.heartbeat.enter("startup", "still starting")
        time.sleep(0.5)
print("ended normally")
"""


def test_a_rank_stuck_in_the_start_dumps_and_exits(tmp_path) -> None:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", STUCK.format(root=tmp_path)], capture_output=True, text=True,
                         timeout=90, env=env_with_venv(), cwd=REPO)
    took = time.monotonic() - t0
    assert out.returncode == 1 and took < 30, (out.returncode, took, out.stderr[-3000:])
    assert "Timeout (0:00:02)!" in out.stderr and "<lambda>" in out.stderr and "identify" not in out.stdout
    assert 'File "<string>"' in out.stderr  # the stack names where it waited


def test_a_healthy_start_is_not_cut_down_later(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-c", HEALTHY.format(root=tmp_path)], capture_output=True, text=True,
                         timeout=90, env=env_with_venv(), cwd=REPO)
    assert out.returncode == 0 and "ended normally" in out.stdout, out.stderr[-3000:]
    assert "Timeout (" not in out.stderr
