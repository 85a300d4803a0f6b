"""Hang requests and answers through the job's store, not through a shared file system's caches (issue 26).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/hang/test_hang_store.py

On an NFS home a file one node writes shows on another node up to a minute later (attribute and lookup caches),
while the ranks have a grace of seconds to answer a hang. Four ranks' watchdogs in one process (rank 1 stopped: a
heartbeat and no watchdog), each thread seeing the other ranks' files in hang/ only 120 s after they were made
(LateFiles below): through files alone the live ranks never see the request and the first rank's requeue record
blames their nodes; through the store every live rank answers within the grace and only the stopped rank's node
is blamed. A store whose server is stopped (rank 0's process, SIGSTOP) holds no watchdog longer than
watchdog.STORE_WAIT_S: the request goes through hang/request, which says so.
"""
from __future__ import annotations

import errno
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from faults import record

from hpctrain.hang import diagnose, ending, watchdog
from hpctrain.hang.heartbeat import Heartbeat
from hpctrain.job import requeue as hangrequeue

pytestmark = pytest.mark.faults


class LateFiles:
    """A shared file system's caches in one process: a file made under `root` by one rank's thread is seen by the
    other ranks' threads only `delay_s` after it was made (a creating open by another rank still meets it, as an
    exclusive create on NFS asks the server). Threads not in rank_of_thread (the test's own) see everything."""

    def __init__(self, monkeypatch, root: Path, delay_s: float) -> None:
        self.root, self.delay_s = os.path.abspath(root) + os.sep, delay_s
        self.rank_of_thread: dict[int, int] = {}
        self.made: dict[str, tuple[int, float]] = {}  # path -> (the rank that made it, when)
        real_open, real_stat, real_lstat, real_scandir = os.open, os.stat, os.lstat, os.scandir

        def opened(path, flags, mode=0o777, *, dir_fd=None):
            p = self._key(path)
            if p is not None and self.hidden(p) and not flags & os.O_CREAT:
                raise FileNotFoundError(errno.ENOENT, "not visible here yet", p)
            fd = real_open(path, flags, mode, dir_fd=dir_fd)
            me = self.rank_of_thread.get(threading.get_ident())
            if p is not None and flags & os.O_CREAT and me is not None and p not in self.made:
                self.made[p] = (me, time.monotonic())
            return fd

        def stat_of(real):
            def look(path, *args, **kwargs):
                p = self._key(path)
                if p is not None and self.hidden(p):
                    raise FileNotFoundError(errno.ENOENT, "not visible here yet", p)
                return real(path, *args, **kwargs)
            return look

        class Listing:
            def __init__(self, it) -> None:
                self.it = it

            def __iter__(self):
                return (e for e in self.it if not late.hidden(os.path.abspath(e.path)))

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                self.it.close()

            def close(self) -> None:
                self.it.close()

        late = self
        monkeypatch.setattr(os, "open", opened)
        monkeypatch.setattr(os, "stat", stat_of(real_stat))
        monkeypatch.setattr(os, "lstat", stat_of(real_lstat))
        monkeypatch.setattr(os, "scandir", lambda path=".": Listing(real_scandir(path)))

    def _key(self, path) -> str | None:
        if isinstance(path, int):
            return None
        p = os.path.abspath(os.fsdecode(path))
        return p if p.startswith(self.root) else None

    def hidden(self, path: str) -> bool:
        me = self.rank_of_thread.get(threading.get_ident())
        maker = self.made.get(path)
        return (me is not None and maker is not None and maker[0] != me
                and time.monotonic() - maker[1] < self.delay_s)


def _ending(monkeypatch) -> tuple[list[str], threading.Event]:
    """end_job records the message and, like the real one, never returns (until the test releases it)."""
    ended: list[str] = []
    released = threading.Event()
    monkeypatch.setattr(watchdog, "end_job", lambda peers, run_dir, message: (ended.append(message),
                                                                               released.wait(60)))
    monkeypatch.setattr(ending, "ENDING", threading.Event())
    return ended, released


def _four_ranks(tmp_path, monkeypatch):
    """Ranks 0, 2, 3 for watchdogs (0 and 3 busy in a checkpoint, 2 in a collective, which the test puts past its
    step limit: it trips first), rank 1 stopped (its heartbeat in a forward, no watchdog), each on a node of its own."""
    ended, released = _ending(monkeypatch)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # the requeue record says "not a Slurm job", nodes named
    limits = watchdog.Limits(step_s=2, long_s=60)  # polls of 0.2 s, a grace of 2.4 s
    hbs = {r: Heartbeat(tmp_path, r, {"node": f"n{r}"}) for r in range(4)}
    for r, hb in hbs.items():
        hb.begin_step(5)
        hb.enter({0: "checkpoint", 1: "forward", 2: "collective", 3: "checkpoint"}[r])
    return hbs, limits, ended, released


def _channel(store, world: int = 4) -> watchdog.StoreChannel:
    return watchdog.StoreChannel(dist.PrefixStore("hpctrain-hang/", store.clone()), world)


def _until(cond, limit_s: float, failure: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit_s, failure
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.mark.parametrize("through_store", [True, False])
def test_answers_reach_the_first_rank_while_files_appear_late(tmp_path, monkeypatch, through_store) -> None:
    late = LateFiles(monkeypatch, tmp_path / "hang", delay_s=120)
    hbs, limits, ended, released = _four_ranks(tmp_path, monkeypatch)
    store = dist.HashStore()
    dogs = []
    t0 = time.monotonic()
    try:
        for r in (0, 3, 2):
            dog = watchdog.Watchdog(hbs[r], tmp_path, limits, channel=_channel(store) if through_store else None)
            late.rank_of_thread[dog._thread.ident] = r
            dogs.append(dog)
        dogs[-1].on_end = functools.partial(hangrequeue.after_hang, tmp_path, 1, 4)  # rank 2's (session.start)
        hbs[2].since -= 30  # past its step limit, now that the shim knows every watchdog thread's rank
        _until(lambda: ended and (tmp_path / "requeues.jsonl").exists(), 20, "the first rank never ended the job")
        if through_store:
            seconds = _until(lambda: len(ended) == 3, 10, f"not every live rank ended: {ended}")
    finally:
        released.set()  # the watchdogs' end_job returns: stop() waits for their threads
        for dog in dogs:
            dog.stop()
    outcome = json.loads((tmp_path / "requeues.jsonl").read_text().splitlines()[-1])
    blamed = {c["rank"]: c["dumped"] for c in outcome["culprits"]}
    if not through_store:  # the shim bites: ranks 0 and 3 never saw the request, and their nodes are blamed
        assert outcome["nodes"] == ["n0", "n1", "n3"] and blamed == {0: False, 1: False, 3: False}, outcome
        assert len(ended) == 1, ended
        return
    assert outcome["nodes"] == ["n1"] and blamed == {1: False}, outcome
    assert all("hang on rank" in m for m in ended) and sum("asked by another rank" in m for m in ended) == 2, ended
    assert time.monotonic() - t0 < limits.grace_s + 5, "the answers came later than the grace"
    acks = json.loads((tmp_path / "hang" / watchdog.ACKS).read_text())["acks"]
    assert sorted(a["rank"] for a in acks) == [0, 2, 3] and all(a["header"]["step"] == 5 for a in acks), acks
    late.rank_of_thread[threading.get_ident()] = 2  # what the first rank sees: its own files and the answers
    report = diagnose.diagnose(tmp_path, history=False)
    del late.rank_of_thread[threading.get_ident()]
    assert [c["rank"] for c in report["culprits"]] == [1], report["lines"]
    assert any("ranks 0, 3 (n0, n3) answered in time through the job's store" in line for line in report["lines"]), \
        report["lines"]
    record("hang dumps and hang/request that other ranks see only 120 s after they were written (a shared file "
           "system's caches), rank 1 stopped, 4 ranks' watchdogs in one process",
           "every live rank answers through the job's store within the grace; the requeue record blames rank 1's "
           "node only (with files alone: ranks 0 and 3 never answer and their nodes are blamed too)", seconds,
           "pure")


@pytest.mark.parametrize("case", ["store", "files", "stuck"])
def test_the_others_end_the_job_only_once_the_first_rank_is_done(tmp_path, monkeypatch, case) -> None:
    """The first rank's on_end (the requeue without the silent ranks' nodes: diagnose, scontrol show, requeue,
    update, the record) takes 1.5 s here. The other ranks' ends (MPI_Abort: every rank of the launch, the first too)
    wait for its word, through the store or hang/ended; CI-32: they ended at the grace and cut the first rank between
    `scontrol requeue` and the ExcNodeList update, so the job ran again on the bad node with no record. A first rank
    that never says (stuck) holds them END_WAIT_S, no longer."""
    hbs, limits, ended, released = _four_ranks(tmp_path, monkeypatch)
    ends: dict[int, float] = {}
    monkeypatch.setattr(watchdog, "end_job", lambda peers, run_dir, message: (
        ends.setdefault(int(message.split()[3].rstrip(":")), time.monotonic()), released.wait(60)))
    done: list[float] = []
    on_end_s = 6.0 if case == "stuck" else 1.5
    if case == "stuck":
        monkeypatch.setattr(watchdog, "END_WAIT_S", 1.0)

    def requeue_slowly() -> str:
        time.sleep(on_end_s)
        done.append(time.monotonic())
        return "requeued (the test's)"

    store = dist.HashStore()
    dogs = []
    try:
        for r in (0, 3, 2):
            dogs.append(watchdog.Watchdog(hbs[r], tmp_path, limits,
                                          channel=_channel(store) if case == "store" else None))
        dogs[-1].on_end = requeue_slowly  # rank 2's: it trips first
        t0 = time.monotonic()
        hbs[2].since -= 30
        _until(lambda: len(ends) == 3, 20, f"not every live rank ended: {ends}")
    finally:
        released.set()
        for dog in dogs:
            dog.stop()
    others = [ends[0], ends[3]]
    if case == "stuck":  # they gave up on it after END_WAIT_S
        assert not done or min(others) < done[0], (ends, done)
        assert max(others) - t0 < limits.poll_s + limits.grace_s + 1.0 + 2, (ends, t0)
        return
    assert done and ends[2] >= done[0] and min(others) >= done[0], (ends, done)
    assert (tmp_path / "hang" / watchdog.ENDED).exists()
    assert max(others) - done[0] < 1.0, (ends, done)  # the word is seen within a poll or so


def _stopped_store():
    """A TCPStore server in a process of its own, and a stop() that SIGSTOPs it (rank 0's process holds the
    server of a job's store). Returns (client, process)."""
    code = ("import sys, time\nimport torch.distributed as dist\n"
            "s = dist.TCPStore('127.0.0.1', 0, 2, is_master=True, wait_for_workers=False)\n"
            "print(s.port, flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
    return client, proc


def test_a_stopped_store_holds_no_watchdog(tmp_path, monkeypatch) -> None:
    client, proc = _stopped_store()
    try:
        ended, released = _ending(monkeypatch)
        limits = watchdog.Limits(step_s=2, long_s=60)
        hbs = {r: Heartbeat(tmp_path, r, {"node": f"n{r}"}) for r in (1, 2)}
        for r, phase in ((1, "checkpoint"), (2, "collective")):
            hbs[r].begin_step(5)
            hbs[r].enter(phase)
        channels = {r: _channel(client, 3) for r in (1, 2)}  # the clients connect while the server runs
        os.kill(proc.pid, signal.SIGSTOP)  # rank 0 stopped, its store server with it
        dogs = [watchdog.Watchdog(hbs[1], tmp_path, limits, channel=channels[1])]
        time.sleep(1.5)  # rank 1's polls meet the stopped store: the first waits STORE_WAIT_S, the rest fail at once
        hbs[2].since -= 30
        dogs.append(watchdog.Watchdog(hbs[2], tmp_path, limits, channel=channels[2]))
        try:
            seconds = _until(lambda: len(ended) == 2, 20, f"the ranks did not end: {ended}")
        finally:
            released.set()
            proc.kill()  # rank 0's process ends: the store calls its stop left the watchdogs fail now, not later
            for dog in dogs:
                dog.stop()
        # rank 2: a poll, STORE_WAIT_S for its request, the grace; rank 1 answered through the file meanwhile
        assert seconds < limits.poll_s + watchdog.STORE_WAIT_S + limits.grace_s + 2, seconds
        request = watchdog.read_request(tmp_path / "hang" / watchdog.REQUEST)
        assert request["rank"] == 2 and "did not answer compare_set" in request["store"], request
        assert watchdog.hang_path(tmp_path, 1).exists() and watchdog.hang_path(tmp_path, 2).exists()
        assert not (tmp_path / "hang" / watchdog.ACKS).exists()
        report = diagnose.diagnose(tmp_path, history=False)
        assert any("the job's store did not carry the request" in line for line in report["lines"]), report["lines"]
    finally:
        proc.kill()
        proc.wait()
    record("the job's store server stopped (SIGSTOP of the process holding it, rank 0's) when a hang is called",
           f"no store operation holds a watchdog past {watchdog.STORE_WAIT_S:g} s; the request goes through "
           "hang/request, which says the store did not carry it; both live ranks dump and end within a poll, that "
           "wait and the grace", seconds, "pure")


RANK_AT_EXIT = """
import datetime, sys, time
import torch.distributed as dist
from hpctrain.hang import watchdog
from hpctrain.hang.heartbeat import Heartbeat

port, run_dir, server_pid = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))


class Answering:  # the store as rank 0 answers it at the end of a job: late (a busy server), until it goes
    def check(self, keys):
        client.wait(["never set"])  # in the store, the GIL released, until the server's process ends


dog = watchdog.Watchdog(Heartbeat(run_dir, 1), run_dir, watchdog.Limits(step_s=2, long_s=60),
                        channel=watchdog.StoreChannel(Answering(), 2))
time.sleep(0.6)  # a poll or two: the watchdog's store call is in flight, held past STORE_WAIT_S
import os, signal
os.kill(server_pid, signal.SIGUSR1)  # rank 0 ends its job: its store goes 0.1 s from now
dog.stop()
print("stopped", flush=True)
"""

STORE_SERVER = """
import datetime, signal, sys, time
import torch.distributed as dist
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])  # for sigwait
server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
print(server.port, flush=True)
signal.sigwait([signal.SIGUSR1])
time.sleep(0.1)
"""


def test_a_store_call_in_flight_as_the_job_ends_does_not_abort_the_rank(tmp_path) -> None:
    """A rank's watchdog may be inside a store call when the job ends; rank 0's process, the store's server, then
    exits and the call returns. Returning while the rank's Python is finalising, the helper thread is ended inside
    C++ and the rank aborts ("terminate called without an active exception", signal 6: seen once in a full run, a
    tp=2 job under mpiexec that had committed its checkpoint). stop() now waits for the call: the rank exits 0."""
    server = subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()
        rank = subprocess.run([sys.executable, "-c", RANK_AT_EXIT, port, str(tmp_path), str(server.pid)],
                              capture_output=True, text=True, timeout=60)
    finally:
        server.kill()
        server.wait()
    assert "terminate called" not in rank.stderr, rank.stderr
    assert rank.returncode == 0 and "stopped" in rank.stdout, rank.stdout + rank.stderr
    record("a rank's watchdog inside a store call when rank 0's process (the store's server) exits at the job's end",
           "the rank waits for the call at stop and exits 0; it aborted in C++ as Python finalised", tier="multiproc")
