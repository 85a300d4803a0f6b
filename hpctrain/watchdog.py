"""The hang watchdog: a thread per rank that watches the rank's heartbeat. When the rank makes no progress (no phase
change) for longer than its phase allows, it writes what it knows into RUN_DIR/hang/ and ends the whole job.

    dog = Watchdog(hb, run_dir, Limits(step_s=180, long_s=1200), peers)  # a daemon thread; session.start does it
    dog.long_until(step + 1)   # up to this step the long limit holds (the first step compiles, sets up NCCL)
    dog.stop()

Limits: step phases (data, forward, backward, optimizer, collective) get parallel.hang_timeout_s; start-up,
checkpoints, evaluation and the first step get parallel.startup_timeout_s. Both are shorter than the collective
timeout (parallel.timeout_s), so the watchdog speaks first, while every rank is still alive to be asked.

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
import os
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hpctrain import ending
from hpctrain.heartbeat import Heartbeat

log = logging.getLogger(__name__)

LONG_PHASES = frozenset({"startup", "checkpoint", "eval"})
REQUEST = "request"
STALE_REQUEST_S = 2.0  # a request older than this rank's start by more than this (clock skew) is the last job's


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
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


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

    def _watch(self) -> None:
        request = self.run_dir / "hang" / REQUEST
        flushed = last = time.monotonic()
        while not self._stop.wait(self.limits.poll_s):
            now = time.monotonic()
            # this thread could not run for a while: the process was stopped (SIGSTOP, until Slurm's SIGCONT) or
            # something held the GIL; a hang seen right after is not this rank's answer in time
            frozen = now - last - self.limits.poll_s if now - last > 3 * self.limits.poll_s + 1 else 0.0
            last = now
            if now - flushed >= 5.0:
                self.hb.flush()
                flushed = now
            limit, setting = self.limit()
            idle = now - self.hb.since
            if idle > limit:
                self._hang(f"no progress for {idle:.0f} s in {self.hb.phase} (limit {limit:g} s: {setting})", True,
                           frozen)
            elif request.exists() and self._asked(request):
                self._hang(f"asked by another rank's watchdog ({request})", False, frozen)

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
            (self.run_dir / "hang").mkdir(exist_ok=True)
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
            wall = json.loads(request.read_text()).get("wall")
        except (OSError, ValueError, AttributeError):
            return True  # unreadable: better one dump too many
        return not isinstance(wall, (int, float)) or wall >= self.hb.facts.get("started", 0) - STALE_REQUEST_S


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
        for path in (Path(run_dir) / "heartbeat").glob("rank*.hb"):
            if path.is_file() and not path.is_symlink():
                shutil.copyfile(path, target / path.name)
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
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime((hang / REQUEST).stat().st_mtime
                                                            if (hang / REQUEST).is_file() else time.time()))
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
    with path.open("w") as f:
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
    path.write_text(json.dumps(out) + "\n")
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
