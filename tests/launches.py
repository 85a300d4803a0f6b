"""Launches of real jobs for the fault and hang tests: a launcher in its own session with its output collected,
rank processes found by their launcher's environment, and what a hang must leave behind.

Used by tests/cluster/job/test_faults_launch.py, tests/cluster/hang/test_hang.py and
tests/multiproc/hang/test_hang_local.py.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from helpers.launch import EXAMPLE, REPO, env_with_venv, tool

# The hang tests' job: a model small enough that a step takes milliseconds, on generated tokens, a watchdog that
# speaks after HANG_S of no progress (well before the 60 s collective timeout)
HANG_S = 4
HANG_SETS = ["data.source=synthetic", "model.n_layers=1", "model.dim=64", "train.log_every=1", "train.steps=100000",
             "checkpoint.at_end=false", "parallel.timeout_s=60", f"parallel.hang_timeout_s={HANG_S}",
             "parallel.startup_timeout_s=120"]
# A rank asleep 0.3 s per step computes ~10x its peers' ~0.03 s; a margin of 100% names it and not a healthy rank
# that the shared machine's load slowed for one log interval (seen at +37% with the default 20%)
STRAGGLER_SETS = ["train.straggler_margin=1.0"]
# every rank gone within the hang limit, the watchdog's poll (0.4 s), its grace period (3.8 s) and this margin
GONE_MARGIN_S = 12


def sets(*values: str) -> list[str]:
    return [a for s in values for a in ("--set", s)]


def rank_pids(env_key: bytes, marker: str) -> dict[int, int]:
    """{rank: pid} of the processes whose command line contains `marker` (the run root) and whose environment
    holds env_key (PMI_RANK, SLURM_PROCID, SUBMITIT_LOCAL_GLOBALID); we are root or the same user, so /proc shows
    them."""
    found = {}
    for env_file in Path("/proc").glob("[0-9]*/environ"):
        try:
            cmdline = (env_file.parent / "cmdline").read_bytes()
            env = env_file.read_bytes().split(b"\0")
        except OSError:
            continue
        argv = cmdline.split(b"\0")
        if marker.encode() not in cmdline or not Path(argv[0].decode(errors="replace")).name.startswith("python"):
            continue  # srun and mpiexec carry the run root in their command lines too
        for item in env:
            if item.startswith(env_key + b"="):
                found[int(item.split(b"=", 1)[1])] = int(env_file.parent.name)
    return found


def state(pid: int) -> str | None:
    """The process's state letter (R, S, T stopped, Z zombie), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Running, sleeping or stopped; a zombie has ended."""
    return state(pid) not in (None, "Z")


def wait_gone(pids: list[int], deadline_s: float) -> float | None:
    """Seconds until none of pids is alive, or None if some still are after deadline_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if not any(alive(p) for p in pids):
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def wait_for_pids(env_key: bytes, marker: str, n: int, timeout_s: float = 60) -> dict[int, int]:
    t0 = time.monotonic()
    while len(pids := rank_pids(env_key, marker)) < n:
        assert time.monotonic() - t0 < timeout_s, f"only {pids} of {n} ranks found"
        time.sleep(0.05)
    return pids


class Launch:
    """A launcher command in its own session; its output lines are collected by a thread."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env_with_venv() | (env or {}), cwd=REPO, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float) -> None:
        t0 = time.monotonic()
        while not re.search(pattern, self.output):
            if time.monotonic() - t0 > timeout_s or self.proc.poll() is not None:
                time.sleep(0.5)
                raise AssertionError(f"never saw {pattern!r} (exit {self.proc.poll()}):\n{self.output[-4000:]}")
            time.sleep(0.05)

    def kill(self, pids: list[int]) -> None:
        """Cleanup: SIGKILL works on stopped processes too."""
        for pid in [*pids, self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait(timeout=30)
        self._reader.join(10)  # the whole output, up to the launcher's exit


def mpi_train(root: Path, n: int, *values: str) -> list[str]:
    return [tool("mpiexec"), "-n", str(n), sys.executable, "-m", "hpctrain.cli", "train", str(EXAMPLE),
            *sets(f"job.run_root={root}", *values)]


def hang_run(launch: Launch, env_key: bytes, root: Path, world: int, culprit: int, stopped: bool,
             cancel: list[str] | None = None, finish_s: float = 120) -> tuple[float | None, dict[int, int]]:
    """Follows a launch whose rank `culprit` stops (SIGSTOP) or falls asleep in a step: waits for every rank's
    process, for the culprit's stop (or its heartbeat in the step), then for every process to be gone. Returns
    (seconds from the stop until all were gone, or None; {rank: pid}); the launcher gets finish_s more to end."""
    pids: dict[int, int] = {}
    try:
        pids = wait_for_pids(env_key, str(root), world, timeout_s=120)
        t0 = time.monotonic()
        while not _culprit_in_step(root, culprit, pids[culprit], stopped):
            assert time.monotonic() - t0 < 180, f"rank {culprit} never reached its fault:\n{launch.output[-3000:]}"
            time.sleep(0.05)
        gone = wait_gone(list(pids.values()), HANG_S + GONE_MARGIN_S + 20)
        launch.proc.wait(timeout=finish_s)
        return gone, pids
    finally:
        if cancel and launch.proc.poll() is None:
            subprocess.run(cancel, timeout=20)
        launch.kill(list(pids.values()))


def _culprit_in_step(root: Path, rank: int, pid: int, stopped: bool) -> bool:
    if stopped:
        return state(pid) == "T"
    from hpctrain.hang import heartbeat
    beats = [heartbeat.read(p) for p in root.glob(f"*/heartbeat/rank{rank:05d}.hb")]
    return any(b.get("phase") == "forward" and b.get("step", 0) > 1 for b in beats)


def check_hang(root: Path, world: int, culprit: int, node: str | None = None) -> dict:
    """What a hang must leave: a stack dump and flight recorder from every live rank, none from a stopped culprit
    (a sleeping one dumps too), and `hpctrain diagnose` naming the culprit (and its node) and the others' waits.
    Returns diagnose's JSON."""
    (run,) = [p for p in root.iterdir() if p.is_dir()]
    hang = run / "hang"  # the last hang of the run; a requeued job's earlier ones are in hang-<time>/
    dumped = sorted(int(p.name[4:9]) for p in hang.glob("rank*.txt"))
    others = [r for r in range(world) if r != culprit]
    assert set(others) <= set(dumped), f"stack dumps of ranks {dumped}, expected every live rank of {others}"
    assert all((hang / f"rank{r:05d}.fr.json").stat().st_size > 0 for r in others)
    assert (hang / "request").is_file()
    out = subprocess.run([tool("hpctrain"), "diagnose", str(run), "--json"], capture_output=True, text=True,
                         timeout=60, env=env_with_venv())
    assert out.returncode == 1, out.stdout + out.stderr  # a hang exits 1
    report = json.loads(out.stdout)
    assert report["kind"] == "hang", report
    assert [c["rank"] for c in report["culprits"]] == [culprit], report["lines"]
    if node is not None:
        assert report["culprits"][0]["node"] == node, report["culprits"]
    assert any("waited in" in line for line in report["lines"]), report["lines"]
    text = subprocess.run([tool("hpctrain"), "diagnose", str(run)], capture_output=True, text=True, timeout=60,
                          env=env_with_venv()).stdout
    assert f"rank {culprit} (" in text.splitlines()[1], text
    return report
