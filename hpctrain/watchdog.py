"""The hang watchdog: a thread per rank that watches the rank's heartbeat. When the rank makes no progress (no phase
change) for longer than its phase allows, it writes what it knows into RUN_DIR/hang/ and ends the whole job.

    dog = Watchdog(hb, run_dir, Limits(step_s=180, long_s=1200), peers)  # a daemon thread; session.start does it
    dog.long_until(step + 1)   # up to this step the long limit holds (the first step compiles, sets up NCCL)
    dog.stop()

Limits: step phases (data, forward, backward, optimizer, collective) get parallel.hang_timeout_s; start-up,
checkpoints, evaluation and the first step get parallel.startup_timeout_s. Both are shorter than the collective
timeout (parallel.timeout_s), so the watchdog speaks first, while every rank is still alive to be asked.

The first step's long limit is for work (compiling, NCCL's set-up), not for silence: every look of the thread is
also a tick in the rank's heartbeat, and a rank idle past half the step limit in its first step reads the ticks of
the next PEERS_WATCHED ranks. A peer whose tick has not changed for the step limit (by this rank's clock: nodes'
clocks are never compared) while this rank is idle past the step limit is stopped, dead or stuck where
Python cannot run, and nothing it could be compiling: the hang is called then, not after the long limit. (Every
start's first step, so the first step after a hang requeue too; a stretch of stopped ranks always follows a live
rank, which watches the first of them.)

What a hang leaves, per live rank:
    hang/rank00003.txt      every thread's Python stack (faulthandler: works while the main thread holds the GIL)
                            under a header: rank, host, step, phase, why
    hang/rank00003.fr.json  torch's flight recorder (parallel.flight_recorder entries; gloo and NCCL): the
                            collectives in flight, per group, with their sequence numbers
The first rank to trip also writes hang/request; every other rank's watchdog sees it within a poll and dumps too
(it may still be computing, or waiting in a collective a stopped peer never joins). Then each waits a grace period
for the others' dumps and ends itself through the launch's abort path: submitit's error result, MPI_Abort (every
rank of an MPI launch), else the peers on its own host that never dumped (stopped, or stuck in the kernel) are
killed and the rank exits 1 (srun --kill-on-bad-exit ends the rest). `hpctrain diagnose RUN_DIR` reads it all.

Why a thread of our own: gloo's collective timeout covers c10d calls, but a DTensor functional collective was seen
waiting past it when a peer was stopped, and a collective timeout names nobody.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import math
import os
import signal
import socket
import stat
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hpctrain import ending, heartbeat
from hpctrain.heartbeat import Heartbeat
from hpctrain.sections import MAX_WORLD_SIZE
from hpctrain.untrusted import Untrusted, read_bytes, read_json

log = logging.getLogger(__name__)

LONG_PHASES = frozenset({"startup", "checkpoint", "eval"})
REQUEST = "request"
REQUEST_BYTES = 64 << 10  # ours is one short line
STALE_REQUEST_S = 2.0  # a request older than this rank's start by more than this (clock skew) is the last job's
# peers whose ticks a rank idle in its first step reads: the next ranks around the ring. One would find any stopped
# stretch (a live rank precedes it); more, so that a neighbour's damaged file does not blind the look, and few, so
# that a big job's ranks do not read the world's files every few seconds from a shared file system
PEERS_WATCHED = 8


@dataclass(frozen=True)
class Limits:
    step_s: float  # parallel.hang_timeout_s: no phase change within a step for this long is a hang
    long_s: float  # parallel.startup_timeout_s: start-up, the first step, checkpoints, evaluation

    @property
    def poll_s(self) -> float:
        """How often the thread looks: a tenth of the step limit, between 0.2 and 5 s (on a shared file system
        each look is one stat of hang/request per rank)."""
        return min(5.0, max(0.2, self.step_s / 10))

    @property
    def flush_s(self) -> float:
        """How often the heartbeat's page goes to the file system for readers on other nodes: 5 s, or half the step
        limit when that is shorter (a live peer's tick, as another node sees it, is never a step limit old)."""
        return min(5.0, self.step_s / 2)

    @property
    def grace_s(self) -> float:
        """How long a rank that dumped waits for the others' dumps before ending itself: two polls and 3 s (less
        for limits under 3 s, as tests use)."""
        return 2 * self.poll_s + min(3.0, self.step_s)


@dataclass(frozen=True)
class Peer:
    """A rank of the job as its own process saw itself at start: enough to end it safely from its host."""
    rank: int
    host: str
    pid: int
    start_ticks: int  # /proc/<pid>/stat field 22: a reused pid has another

    @staticmethod
    def me(rank: int) -> Peer:
        return Peer(rank, socket.gethostname(), os.getpid(), process_start(os.getpid()) or 0)


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, None when it is gone."""
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(line.rsplit(")", 1)[1].split()[19])


def hang_path(run_dir: Path, rank: int, suffix: str = ".txt") -> Path:
    return Path(run_dir) / "hang" / f"rank{rank:05d}{suffix}"


class Watchdog:
    def __init__(self, hb: Heartbeat, run_dir: str | Path, limits: Limits, peers: list[Peer] | None = None) -> None:
        self.hb, self.limits = hb, limits
        self.run_dir = Path(run_dir)
        self.peers = peers or []
        # called by the first rank to trip once every live rank has dumped, before the job ends (the trainer's:
        # hangrequeue.after_hang); returns one line to log
        self.on_end: Callable[[], str] | None = None
        self.long_until_step = 1  # steps up to this one (and start-up before them) have the long limit
        self._watched: tuple[list[Peer] | None, list[Peer]] = (None, [])  # (of which peers list, the ones watched)
        # rank -> (its last tick read, this rank's monotonic time when it changed)
        self._ticks: dict[int, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hpctrain-watchdog", daemon=True)
        self._thread.start()

    def long_until(self, step: int) -> None:
        self.long_until_step = step

    def stop(self) -> None:
        self._stop.set()

    def limit(self) -> tuple[float, str]:
        """The current phase's limit and the setting it comes from."""
        if self.hb.phase in LONG_PHASES or self.hb.step <= self.long_until_step:
            return self.limits.long_s, "parallel.startup_timeout_s"
        return self.limits.step_s, "parallel.hang_timeout_s"

    def in_first_step(self) -> bool:
        """A step phase that has the long limit only because the step is the first since the start."""
        return self.hb.phase not in LONG_PHASES and self.hb.step <= self.long_until_step

    def _watch(self) -> None:
        request = self.run_dir / "hang" / REQUEST
        flushed = last = time.monotonic()
        while not self._stop.wait(self.limits.poll_s):
            now = time.monotonic()
            # this thread could not run for a while: the process was stopped (SIGSTOP, until Slurm's SIGCONT) or
            # something held the GIL; a hang seen right after is not this rank's answer in time
            frozen = now - last - self.limits.poll_s if now - last > 3 * self.limits.poll_s + 1 else 0.0
            last = now
            self.hb.tick()
            if now - flushed >= self.limits.flush_s:
                try:
                    self.hb.flush()
                except OSError as e:  # a file system gone for a moment: the next flush tries again
                    log.warning("heartbeat not flushed: %s", e)
                flushed = now
            limit, setting = self.limit()
            idle = now - self.hb.since
            if idle > limit:
                self._hang(f"no progress for {idle:.0f} s in {self.hb.phase} (limit {limit:g} s: {setting})", True,
                           frozen)
            elif request.exists() and self._asked(request):
                self._hang(f"asked by another rank's watchdog ({request})", False, frozen)
            elif idle > self.limits.step_s / 2 and self.in_first_step():
                silent = self.silent_peers()  # at most PEERS_WATCHED small reads a poll, in this window only
                if silent and idle > self.limits.step_s:
                    who = ", ".join(f"rank {r} ({age:.0f} s)" for r, age in silent)
                    self._hang(f"no progress for {idle:.0f} s in {self.hb.phase} of the first step while the "
                               f"watchdog of {who} was silent: stopped, dead or stuck (limit "
                               f"{self.limits.step_s:g} s: parallel.hang_timeout_s; the first step's long limit "
                               f"holds while every rank is alive)", True, frozen)

    def silent_peers(self) -> list[tuple[int, float]]:
        """(rank, seconds) of the next PEERS_WATCHED ranks whose tick has not changed for longer than the step limit
        by this rank's clock (read from half the step limit on, so a verdict comes by 1.5 step limits). A heartbeat
        that is unreadable, another process's, or of a rank that ended is no evidence: skipped; so is a peer in a
        long phase (loading a checkpoint, h5py may hold the GIL for long: its own limit holds)."""
        if self._watched[0] is not self.peers:  # the session sets the peers once, after the rendezvous
            peers = sorted(self.peers, key=lambda p: p.rank)
            ranks = [p.rank for p in peers]
            me = ranks.index(self.hb.rank) if self.hb.rank in ranks else 0
            self._watched = (self.peers, [peers[(me + k) % len(peers)] for k in
                                          range(1, min(len(peers), PEERS_WATCHED + 1))] if self.hb.rank in ranks
                             else [])
        now, silent = time.monotonic(), []
        for peer in self._watched[1]:
            beat = heartbeat.read(heartbeat.heartbeat_path(self.run_dir, peer.rank))
            tick = beat.get("alive")
            if "error" in beat or beat.get("pid") != peer.pid or tick is None \
                    or beat.get("phase") in LONG_PHASES | {"done", "failed"}:
                self._ticks.pop(peer.rank, None)
                continue
            # the peer's tick is its own node's clock: only whether it changes is compared, over this rank's clock,
            # so skew between nodes never makes a live peer look silent
            seen = self._ticks.get(peer.rank)
            if seen is None or seen[0] != tick:
                self._ticks[peer.rank] = (tick, now)
            elif now - seen[1] > self.limits.step_s:
                silent.append((peer.rank, now - seen[1]))
        return silent

    def _hang(self, reason: str, first: bool, frozen_s: float = 0.0) -> None:
        """Dumps what this rank knows, then ends the job, whatever fails on the way (a full file system, a log
        handler whose stream is gone): the ending is in a finally."""
        t0 = time.monotonic()
        initiator = False
        ending.ENDING.set()  # from here this thread ends the job; the main thread's failures wait for it
        hb = self.hb
        where = f"step {hb.step}, phase {hb.phase}" + (f" ({hb.detail})" if hb.detail else "")
        message = (f"hang on rank {hb.rank}: {reason} at {where}; see {self.run_dir / 'hang'} and run "
                   f"`hpctrain diagnose {self.run_dir}`")
        try:
            log.error("hang: %s at %s; stacks and the flight recorder go to %s, then the job ends", reason, where,
                      self.run_dir / "hang")
            hang_dir(self.run_dir)
            initiator = first and write_request(self.run_dir, hb.rank, reason, self.limits.grace_s)
            dump_stacks(hang_path(self.run_dir, hb.rank), hb, reason, time.monotonic() - hb.since, frozen_s)
            dump_flight_recorder(hang_path(self.run_dir, hb.rank, ".fr.json"))
            hb.flush()
            for h in logging.getLogger().handlers:
                h.flush()
        except Exception as e:  # noqa: BLE001 - nothing may keep a hung job alive
            print(f"hpctrain: hang dump of rank {hb.rank} failed: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
        finally:
            time.sleep(max(0.0, self.limits.grace_s - (time.monotonic() - t0)))  # not stop(): the job is ending
            if initiator:
                snapshot_heartbeats(self.run_dir)
            if initiator and self.on_end is not None:
                try:
                    said = self.on_end()
                    message += f"; {said}"
                    print(f"hpctrain: after the hang: {said}", file=sys.stderr, flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"hpctrain: after the hang: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            end_job(self.peers, self.run_dir, message)

    def _asked(self, request: Path) -> bool:
        """Another rank's request of this incarnation of the job (a requeued job finds the last one's)."""
        try:
            wall = read_request(request).get("wall")
        except Untrusted:
            return True  # unreadable (damaged, a link, a FIFO): better one dump too many
        return wall is None or wall >= self.hb.facts.get("started", 0) - STALE_REQUEST_S


def hang_dir(run_dir: Path) -> Path:
    """RUN_DIR/hang, made if missing; OSError when it is anything but a directory of its own (a planted link would
    take the dumps out of the run directory)."""
    path = Path(run_dir) / "hang"
    path.mkdir(exist_ok=True)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise OSError(f"{path} is not a directory (a symbolic link?): nothing is written through it")
    return path


def _create(path: Path, mode: str = "w"):
    """A file opened for writing, made or truncated, never through a symbolic link (OSError then)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644),
                     mode)


def _number(v: Any) -> float | None:
    return float(v) if type(v) in (int, float) and math.isfinite(v) else None


def read_request(path: Path) -> dict[str, Any]:
    """hang/request, as write_request made it: {"rank", "reason", "wall", "grace_s"} with only the fields of the
    right type; "damaged" lists the others. Raises Untrusted for a file that is not one (a link, a FIFO, too large,
    not a JSON object)."""
    data = read_json(path, REQUEST_BYTES)
    if not isinstance(data, dict):
        raise Untrusted(f"{str(path)!r}: not a JSON object")
    rank, reason = data.get("rank"), data.get("reason")
    grace = _number(data.get("grace_s"))
    fields = {"rank": rank if type(rank) is int and 0 <= rank < MAX_WORLD_SIZE else None,
              "reason": reason if isinstance(reason, str) else None, "wall": _number(data.get("wall")),
              "grace_s": grace if grace is not None and grace >= 0 else None}
    damaged = sorted(k for k, v in fields.items() if v is None and k in data)
    return {k: v for k, v in fields.items() if v is not None} | ({"damaged": damaged} if damaged else {})


def write_request(run_dir: Path, rank: int, reason: str, grace_s: float = 0.0) -> bool:
    """hang/request, made by the first rank to trip only (O_EXCL); False when another rank's is there. It says
    how long the ranks have to answer (grace_s): a dump made much later came from a rank that was stopped then
    (Slurm sends SIGCONT when it ends or requeues a job), and diagnose does not count it."""
    try:
        fd = os.open(Path(run_dir) / "hang" / REQUEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"rank": rank, "reason": reason, "wall": time.time(), "grace_s": grace_s}) + "\n")
    return True


def snapshot_heartbeats(run_dir: Path) -> None:
    """Every rank's heartbeat as the hang left it, into hang/heartbeat/ (the first rank to trip, once the others
    had their time to dump): what a woken rank or a requeued job writes later does not blur it."""
    target = Path(run_dir) / "hang" / "heartbeat"
    try:
        target.mkdir(exist_ok=True)
        if not stat.S_ISDIR(os.lstat(target).st_mode):
            raise OSError(f"{target} is not a directory (a symbolic link?)")
        for path in (Path(run_dir) / "heartbeat").glob("rank*.hb"):
            try:
                raw = read_bytes(path, heartbeat.FILE_BYTES)
            except Untrusted:
                continue  # not a heartbeat (a link, a FIFO, too large): diagnose names it in heartbeat/
            with _create(target / path.name, "wb") as f:
                f.write(raw)
    except OSError as e:
        print(f"hpctrain: heartbeats not kept with the hang: {e}", file=sys.stderr, flush=True)


def keep_earlier_hang(run_dir: Path) -> Path | None:
    """At the start of a job that runs again in its run directory (a requeue), before any rank opens its heartbeat:
    the earlier hang's files and the heartbeats they go with move to hang-<time of its request>/ (hang/,
    heartbeat/), which `hpctrain diagnose` reads as a run directory of its own; this incarnation's are its own.
    Rank 0 only."""
    run_dir = Path(run_dir)
    hang = run_dir / "hang"
    if not hang.is_dir() or hang.is_symlink():
        return None
    try:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.lstat(hang / REQUEST).st_mtime))
    except (OSError, OverflowError, ValueError):  # no request, or a time stamp no calendar holds
        stamp = time.strftime("%Y%m%d-%H%M%S")
    target = run_dir / f"hang-{stamp}"
    n = 1
    while target.exists():
        n += 1
        target = run_dir / f"hang-{stamp}-{n}"
    target.mkdir()
    hang.rename(target / "hang")
    beats = run_dir / "heartbeat"
    if beats.is_dir() and not beats.is_symlink():
        beats.rename(target / "heartbeat")
    return target


def dump_stacks(path: Path, hb: Heartbeat, reason: str, idle_s: float, frozen_s: float = 0.0) -> None:
    """Every thread's stack into `path`, under a header a reader (hpctrain diagnose) can parse."""
    names = {t.ident: t.name for t in threading.enumerate()}
    with _create(path) as f:
        header = {"rank": hb.rank, "host": socket.gethostname(), "node": hb.facts.get("node"), "pid": os.getpid(),
                  "step": hb.step, "phase": hb.phase, "detail": hb.detail, "idle_s": round(idle_s, 1),
                  "frozen_s": round(frozen_s, 1), "reason": reason, "wall": round(time.time(), 3),
                  "threads": {f"0x{k:016x}": v for k, v in names.items() if k}}
        f.write("# hpctrain hang dump " + json.dumps(header) + "\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)


def dump_flight_recorder(path: Path) -> bool:
    """torch's flight recorder as JSON into `path` ({"fr": gloo and other host-side groups, "nccl": NCCL's});
    False when this torch has none or it was off (parallel.flight_recorder = 0)."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return False
    out: dict[str, Any] = {}
    for key, name in (("fr", "_dump_fr_trace_json"), ("nccl", "_dump_nccl_trace_json")):
        fn = getattr(c10d, name, None)  # NCCL's exists in CUDA builds only
        if fn is None:
            continue
        try:
            out[key] = json.loads(fn(True, False))
        except Exception as e:  # noqa: BLE001 - a failed dump must never stop the rest of the hang path
            out[key] = {"error": f"{type(e).__name__}: {e}"}
    if not out:
        return False
    with _create(path) as f:
        f.write(json.dumps(out) + "\n")
    return True


def end_job(peers: list[Peer], run_dir: Path, message: str) -> None:
    """The abort path of a hang, as of any failed rank: submitit's error result (`submit --wait` reports it), then
    MPI_Abort under MPI (returns without MPI), else the same-host peers that left no dump are killed (a stopped
    rank would otherwise outlive the job where no launcher ends it), then exit 1."""
    print(f"hpctrain: {message}", file=sys.stderr, flush=True)
    ending.leave_task_error(message)
    ending.abort_launch(1)
    host, me = socket.gethostname(), os.getpid()
    for p in peers:
        if p.host == host and p.pid != me and not hang_path(run_dir, p.rank).exists() \
                and process_start(p.pid) == p.start_ticks:
            try:
                os.kill(p.pid, signal.SIGKILL)
                log.error("killed rank %d (pid %d), which left no hang dump", p.rank, p.pid)
            except OSError:
                pass
    logging.shutdown()
    os._exit(1)
