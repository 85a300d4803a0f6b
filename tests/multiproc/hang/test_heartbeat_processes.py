"""Heartbeats and the watchdog across real processes: a killed or stopped process, a peer's kill, a stopped then
woken watchdog (the rest: tests/pure/hang/test_heartbeat.py).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/hang/test_heartbeat_processes.py
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faults import record

from helpers.hang import a_watchdog, until_ended
from helpers.launch import REPO
from hpctrain.hang import diagnose, heartbeat, watchdog


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_last_phase_outlives_the_process(tmp_path, sig) -> None:
    """The mapped page belongs to the kernel: a rank killed or stopped inside forward still reads as there."""
    code = ("import os, signal, sys\nfrom hpctrain.hang.heartbeat import Heartbeat\n"
            "hb = Heartbeat(sys.argv[1], 3, {'node': 'n9'})\nhb.begin_step(7)\nhb.enter('forward', 'micro-batch 2/4')\n"
            f"os.kill(os.getpid(), signal.{sig})\nhb.enter('backward')\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO)
    try:
        if sig == "SIGKILL":
            proc.wait(timeout=60)
        else:
            t0 = time.monotonic()
            while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
                assert time.monotonic() - t0 < 60, "the process never stopped"
                time.sleep(0.02)
        got = heartbeat.read(heartbeat.heartbeat_path(tmp_path, 3))
    finally:
        proc.kill()
        proc.wait()
    assert (got["step"], got["phase"], got["detail"], got["node"]) == (7, "forward", "micro-batch 2/4", "n9")


class _Ended(Exception):
    pass


def test_peer_kill_needs_the_same_process(tmp_path, monkeypatch) -> None:
    """end_job kills only same-host peers that left no dump and are still the process they were at start."""
    code = "import time; time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    dumped = subprocess.Popen([sys.executable, "-c", code])
    try:
        start = watchdog.process_start(proc.pid)
        me = watchdog.Peer.me(0)
        peers = [me, watchdog.Peer(1, me.host, proc.pid, start), watchdog.Peer(2, me.host, dumped.pid,
                 watchdog.process_start(dumped.pid)), watchdog.Peer(3, me.host, os.getpid(), start + 1)]
        (tmp_path / "hang").mkdir()
        watchdog.hang_path(tmp_path, 2).write_text("dumped")
        monkeypatch.setattr(watchdog.os, "_exit", lambda code: (_ for _ in ()).throw(_Ended(code)))
        monkeypatch.setattr(watchdog.logging, "shutdown", lambda: None)
        with pytest.raises(_Ended):
            watchdog.end_job(peers, tmp_path, "test")
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert dumped.poll() is None  # it dumped: it ends itself
    finally:
        for p in (proc, dumped):
            p.kill()
            p.wait()


def test_a_stopped_then_woken_watchdog_says_it_was_frozen(tmp_path) -> None:
    """SIGSTOP for 4 s, then SIGCONT (as Slurm sends when it ends or requeues a job): the watchdog trips at once,
    and its dump says how long it could not run, so diagnose does not count it as an answer in time."""
    code = ("import sys, time\nfrom hpctrain.hang import watchdog\nfrom hpctrain.hang.heartbeat import Heartbeat\n"
            "hb = Heartbeat(sys.argv[1], 1, {'node': 'n2'})\nhb.begin_step(3)\nhb.enter('forward')\n"
            "watchdog.Watchdog(hb, sys.argv[1], watchdog.Limits(step_s=2, long_s=60))\n"
            "print('ready', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(4)
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.wait(timeout=30) == 1  # the watchdog ended it
    finally:
        proc.kill()
        proc.wait()
    header, _ = diagnose.parse_dump(watchdog.hang_path(tmp_path, 1).read_text())
    assert header["frozen_s"] >= 3, header


PEER = ("import sys, time\nfrom hpctrain.hang import watchdog\nfrom hpctrain.hang.heartbeat import Heartbeat\n"
        "hb = Heartbeat(sys.argv[1], 3, {'node': 'n2'})\nhb.begin_step(1)\nhb.enter('forward')\n"
        "watchdog.Watchdog(hb, sys.argv[1], watchdog.Limits(step_s=1, long_s=60))\n"
        "print('ready', flush=True)\ntime.sleep(120)\n")


@pytest.mark.faults
def test_a_stopped_peer_ends_the_first_steps_long_limit(tmp_path, monkeypatch) -> None:
    """The first step of every start (a requeued job's after a hang too) has the long limit: it compiles and sets up
    NCCL. A peer that is stopped is not compiling: its watchdog falls silent. A rank idle past the step limit in its
    first step whose neighbour's watchdog is silent for the step limit trips then, not after the long limit (1200 s
    by default: the second stop of the Slurm requeue test took that long). A neighbour that is alive keeps the long
    limit."""
    proc = subprocess.Popen([sys.executable, "-c", PEER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        dog, hb, ended = a_watchdog(tmp_path, monkeypatch, watchdog.Limits(step_s=1, long_s=60), "collective", step=1)
        me = watchdog.Peer.me(2)
        dog.peers = [me, watchdog.Peer(3, me.host, proc.pid, watchdog.process_start(proc.pid))]
        hb.begin_training(0)  # a fresh start: step 1 is the first
        hb.begin_step(1)
        time.sleep(3)  # idle well past the step limit, the peer alive (its watchdog runs): the long limit holds
        assert not ended and heartbeat.read(heartbeat.heartbeat_path(tmp_path, 3))["alive"] > time.time() - 2
        os.kill(proc.pid, signal.SIGSTOP)
        seconds = until_ended(ended, "a stopped peer was not noticed within the step limit")
        dog.stop()
    finally:
        proc.kill()
        proc.wait()
    assert "rank 3" in ended[0] and "silent" in ended[0] and "parallel.hang_timeout_s" in ended[0], ended[0]
    request = json.loads((tmp_path / "hang" / "request").read_text())
    assert request["rank"] == 2 and "rank 3" in request["reason"], request
    record("a peer stopped (SIGSTOP) in the first step, which has the long limit (60 s here, 1200 s by default; a "
           "second stop after a hang requeue is one), while this rank waits past the step limit (1 s)",
           "an alive peer keeps the long limit; once stopped, this rank's watchdog trips within 20 s naming the "
           "peer's silent watchdog", seconds, "unit")
