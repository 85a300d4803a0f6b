"""Heartbeats: where each rank is right now (step, phase, since when), kept where its watchdog and, after the
job, `hpctrain diagnose` can read it, and how long the rank spent working and waiting (the straggler report).

    hb = Heartbeat(run_dir, rank, {"host": ..., "node": ..., "coords": {...}})  # RUN_DIR/heartbeat/rank00005.hb
    hb.enter("forward")                                   # a phase change
    hb.enter("collective", "all_reduce of the loss on dp")  # a wait for other ranks
    hb.begin_training(11)                                 # training goes on after step 11 (0: a fresh start)
    hb.begin_step(12)                                     # step 12 begins (its phases follow)
    compute_s, wait_s = hb.take_times()                   # since the last take (log steps)
    hb.advance(0, total=846 * 10**9)                      # a checkpoint's read or write moves this much in all
    hb.advance(nbytes)                                    # bytes of it read or written just now: progress

Cheap enough for every phase of every step: a phase change is a clock read and one copy of a short line into a
shared file mapping (no system call, no lock). The kernel owns the mapped page, so the last line survives the
process: a rank stopped (SIGSTOP) or killed in the middle of a step still says where it was. msync (flush(), from
the watchdog's thread every few seconds) pushes it to a shared file system for readers on other nodes.

The file is 1024 bytes: a 256-byte live line, this rank's fixed facts as JSON (rank, pid, host, node, mesh
coordinates, start time), then a 32-byte line the watchdog's thread rewrites at every look (tick()): a rank whose
watchdog falls silent is stopped, dead or stuck where Python cannot run, however long its phase may last. Nothing
read back is trusted: read() reads at most the file's size, never through a link, and checks both lines' crc32
and every fact's type.

Phases: startup, data, forward, backward, optimizer, collective (waiting on a group: an explicit collective, or
the gradient reduction DDP/FSDP finish after the backward's compute), eval, checkpoint, done. Time in collective
counts as wait, everything else as compute. Imports hpctrain.untrusted and the config's rank limit, no torch.

A checkpoint's read or write (a resume reads the whole checkpoint twice) is one long phase that can take far
longer than any fixed limit on slow storage: the checkpoint code reports every dataset it reads or writes
(advance()), so the watchdog measures its idle time from the last bytes moved, not from the phase's start, and
grows the phase's limit by the time the whole job's bytes take at the configured storage rate. advance() may come
from a background saver's thread: it only sets numbers; the mapped line is rewritten from the heartbeat's own
thread only (two writers could tear it).
"""
from __future__ import annotations

import json
import math
import mmap
import os
import re
import stat
import threading
import time
import zlib
from pathlib import Path
from typing import Any

from hpctrain.config.sections import MAX_WORLD_SIZE
from hpctrain.untrusted import Untrusted, parse_json, read_bytes

PHASES = ("startup", "data", "forward", "backward", "optimizer", "collective", "eval", "checkpoint", "done",
          "failed")
WAIT_PHASES = frozenset({"collective"})
LIVE_BYTES = 256
FILE_BYTES = 1024
TICK_AT = FILE_BYTES - 32  # the watchdog's line: the last 32 bytes; the facts lie between it and the live line
LINE = re.compile(r"HB (\d+) (-?\d+) ([a-z]+) (\d+\.\d+) ([0-9a-f]{8})(?: (.*))?")
TICK = re.compile(r"WD (\d{1,12}\.\d{3}) ([0-9a-f]{8})")
# the type of each fact a reader uses (the writers: session.start, set_facts); any other is kept as it is
FACT_TYPES: dict[str, tuple[type, ...]] = {"rank": (int,), "pid": (int,), "host": (str,), "node": (str,),
                                           "local_rank": (int,), "job_id": (str,), "launcher": (str,),
                                           "started": (int, float), "coords": (dict,), "failure": (str,)}


def heartbeat_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / "heartbeat" / f"rank{rank:05d}.hb"


class Heartbeat:
    """This rank's live position. run_dir None keeps it in memory only (tests, tools without a run directory).

    `device_clock` (optional) is told of every change between computing and waiting (mark(waiting)), for
    devices whose work the host's clock does not see (CUDA events: hpctrain.hang.stragglers.CudaClock)."""

    def __init__(self, run_dir: str | os.PathLike | None, rank: int, facts: dict[str, Any] | None = None,
                 device_clock: Any = None) -> None:
        self.rank = rank
        self.step = 0
        # the first step since the process started (begin_training): it compiles, allocates and sets up NCCL, so
        # the watchdog gives it, and start-up before it, the long limit
        self.first_step = 1
        self.phase, self.detail = "startup", ""
        self.since = time.monotonic()  # when the current phase began (the watchdog's clock)
        self.wall = time.time()  # the same moment on the wall clock (written out; comparable across hosts)
        self.changes = 0
        self.times = [0.0, 0.0]  # seconds computing, waiting: since the last take_times()
        self.progressed = self.since  # when checkpoint bytes last moved (advance()): the watchdog's idle clock
        self.moved = 0  # bytes of checkpoint data read or written since the phase began
        self.io_total = 0  # bytes the job's current checkpoint read or write moves in all (advance(total=...))
        self._owner = threading.get_ident()  # the one thread that writes the mapped line
        self.device_clock = device_clock
        self._mm: mmap.mmap | None = None
        self.facts = dict(facts or {}, rank=rank, pid=os.getpid(), started=round(self.wall, 3))
        self.path = None if run_dir is None else heartbeat_path(run_dir, rank)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if stat.S_ISLNK(os.lstat(self.path.parent).st_mode):  # never write through a planted link
                raise OSError(f"{self.path.parent} is a symbolic link: no heartbeat is written through it")
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            try:
                os.ftruncate(fd, FILE_BYTES)
                self._mm = mmap.mmap(fd, FILE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)  # the mapping keeps the file
            self.set_facts()
        self._write()

    def set_facts(self, **more: Any) -> None:
        """Adds to this rank's fixed facts (mesh coordinates once known, the error of a failed rank)."""
        self.facts.update(more)
        if self._mm is None:
            return
        static = json.dumps(self.facts, sort_keys=True, ensure_ascii=True).encode()
        room = TICK_AT - LIVE_BYTES - 1
        if len(static) > room:  # a long error message: shorten the strings
            short = {k: v[:60] if isinstance(v, str) else v for k, v in self.facts.items()}
            static = json.dumps(short, sort_keys=True, ensure_ascii=True).encode()
        if len(static) > room:
            raise ValueError(f"heartbeat facts of rank {self.rank} take {len(static)} bytes, more than {room}")
        self._mm[LIVE_BYTES:TICK_AT] = static.ljust(room) + b"\n"

    def enter(self, phase: str, detail: str = "") -> None:
        """The rank begins `phase` now (one of PHASES; detail says more, e.g. which collective on which group)."""
        now = time.monotonic()
        was_waiting = self.phase in WAIT_PHASES
        self.times[was_waiting] += now - self.since
        waiting = phase in WAIT_PHASES
        if self.device_clock is not None and waiting != was_waiting:
            self.device_clock.mark(waiting)
        self.phase, self.detail, self.since, self.wall = phase, detail, now, time.time()
        self.moved = 0
        self._write()

    def advance(self, nbytes: int = 0, total: int | None = None) -> None:
        """Checkpoint data moved: `nbytes` read or written just now (progress: the watchdog's idle clock starts
        again); `total`, when given, is what the whole job's read or write of the checkpoint moves (its time at the
        storage rate is added to the long limit). Safe from any thread (a background save's)."""
        self.progressed = time.monotonic()
        self.moved += nbytes
        if total is not None:
            self.io_total = total
        if threading.get_ident() == self._owner:
            self._write()

    @property
    def described(self) -> str:
        """The phase's detail, with the checkpoint bytes moved in it so far."""
        if not self.moved:
            return self.detail
        moved = f"{self.moved / 1e9:.1f} GB" if self.moved >= 1e9 else f"{self.moved / 1e6:.1f} MB"
        return f"{self.detail}; {moved} moved" if self.detail else f"{moved} moved"

    def begin_step(self, step: int) -> None:
        """The step being worked on from now: its phases, and the checks and saves after it, carry its number
        (start-up carries the step training resumes after)."""
        self.step = step
        self._write()

    def begin_training(self, step: int) -> None:
        """Start-up is over and training goes on after `step` (the step resumed from; 0 for a fresh start): the
        checks and polls before the first step carry `step`, and step + 1 is the first step since the start."""
        self.first_step = step + 1
        self.begin_step(step)

    def take_times(self) -> tuple[float, float]:
        """(compute_s, wait_s) since the last call, the current phase counted up to now. With a device clock, its
        (device) times instead: call after the device finished the steps (a log step's synchronisation)."""
        self.enter(self.phase, self.detail)  # closes the running phase's share
        host = (self.times[0], self.times[1])
        self.times = [0.0, 0.0]
        return self.device_clock.take() if self.device_clock is not None else host

    def _write(self) -> None:
        self.changes += 1
        if self._mm is None:
            return
        detail = self.described.encode("ascii", "replace")[:160]
        body = b"%d %d %s %.3f" % (self.changes, self.step, self.phase.encode(), self.wall)
        line = b"HB %s %08x %s" % (body, zlib.crc32(body + b" " + detail), detail)
        self._mm[:LIVE_BYTES] = line.ljust(LIVE_BYTES - 1) + b"\n"

    def tick(self) -> None:
        """The watchdog's thread ran just now (its own line, apart from the main thread's live line): peers tell a
        rank that is busy for long (compiling) from one that is stopped or dead by it."""
        mm = self._mm
        if mm is None:
            return
        body = b"%.3f" % time.time()
        try:
            mm[TICK_AT:] = (b"WD %s %08x" % (body, zlib.crc32(body))).ljust(FILE_BYTES - TICK_AT - 1) + b"\n"
        except ValueError:  # closed by the main thread meanwhile: the rank is ending
            pass

    def flush(self) -> None:
        """Pushes the mapped page to the file system (other nodes see it); the watchdog calls it periodically."""
        if self._mm is not None:
            self._mm.flush()

    def close(self, phase: str = "done") -> None:
        if self._mm is not None:
            self.enter(phase)
            self._mm.flush()
            self._mm.close()
            self._mm = None


def _fact_error(facts: dict[str, Any]) -> str | None:
    """Why these facts are not a heartbeat's, or None."""
    for key, types in FACT_TYPES.items():
        v = facts.get(key)
        if key in facts and (not isinstance(v, types) or isinstance(v, bool)) and not (key == "node" and v is None):
            return f"its fact {key} is a {type(v).__name__}"
    rank = facts.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < MAX_WORLD_SIZE:
        return f"its facts name no rank in [0, {MAX_WORLD_SIZE}) (rank {str(rank)[:24]})"
    coords = facts.get("coords", {})
    if not all(isinstance(k, str) and type(v) is int for k, v in coords.items()):
        return "its fact coords is not a map of axis names to integers"
    if isinstance(facts.get("started"), float) and not math.isfinite(facts["started"]):
        return "its fact started is not finite"
    return None


def read(path: str | os.PathLike) -> dict[str, Any]:
    """One heartbeat file: {"rank", "pid", "host", ..., "step", "phase", "detail", "wall", "changes"} and "alive"
    (the wall time of its watchdog's last look, when it has one), or {"error": why} (with the facts when they
    were readable) for a file that is not one: too big, a link, torn, foreign, facts of the wrong types. Never
    trusts the file and never raises."""
    p = Path(path)
    try:
        raw = read_bytes(p, FILE_BYTES)
        if len(raw) != FILE_BYTES:
            return {"error": f"{p.name}: not a {FILE_BYTES}-byte heartbeat file"}
        facts = parse_json(raw[LIVE_BYTES:TICK_AT].decode("ascii"), "its facts")
        live = raw[:LIVE_BYTES].decode("ascii").rstrip()
        tick = raw[TICK_AT:].decode("ascii").rstrip()
    except Untrusted as e:
        return {"error": f"{p.name}: {e}"}
    except UnicodeDecodeError:
        return {"error": f"{p.name}: unreadable"}
    if not isinstance(facts, dict):
        return {"error": f"{p.name}: its facts hold no rank"}
    why = _fact_error(facts)
    if why is not None:
        return {"error": f"{p.name}: {why}"}
    m = LINE.fullmatch(live)
    if m is None:
        return {**facts, "error": f"{p.name}: no live line"}
    changes, step, phase, wall, crc, detail = m.groups(default="")
    body = f"{changes} {step} {phase} {wall}".encode()
    if zlib.crc32(body + b" " + detail.encode()) != int(crc, 16) or phase not in PHASES:
        return {**facts, "error": f"{p.name}: torn or damaged live line"}
    out = {**facts, "step": int(step), "phase": phase, "detail": detail, "wall": float(wall),
           "changes": int(changes)}
    t = TICK.fullmatch(tick)
    if t is not None and zlib.crc32(t.group(1).encode()) == int(t.group(2), 16):
        out["alive"] = float(t.group(1))
    return out
