"""Heartbeats: where each rank is right now (step, phase, since when), kept where its watchdog and, after the
job, `hpctrain diagnose` can read it, and how long the rank spent working and waiting (the straggler report).

    hb = Heartbeat(run_dir, rank, {"host": ..., "node": ..., "coords": {...}})  # RUN_DIR/heartbeat/rank00005.hb
    hb.enter("forward")                                   # a phase change
    hb.enter("collective", "all_reduce of the loss on dp")  # a wait for other ranks
    hb.begin_step(12)                                     # step 12 begins (its phases follow)
    compute_s, wait_s = hb.take_times()                   # since the last take (log steps)

Cheap enough for every phase of every step: a phase change is a clock read and one copy of a short line into a
shared file mapping (no system call, no lock). The kernel owns the mapped page, so the last line survives the
process: a rank stopped (SIGSTOP) or killed in the middle of a step still says where it was. msync (flush(), from
the watchdog's thread every few seconds) pushes it to a shared file system for readers on other nodes.

The file is 1024 bytes: a 256-byte live line, then this rank's fixed facts as JSON (rank, pid, host, node, mesh
coordinates, start time). Nothing read back is trusted: read() checks the line's crc32 and its fields.

Phases: startup, data, forward, backward, optimizer, collective (waiting on a group: an explicit collective, or
the gradient reduction DDP/FSDP finish after the backward's compute), eval, checkpoint, done. Time in collective
counts as wait, everything else as compute. Imports nothing of hpctrain and no torch.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import time
import zlib
from pathlib import Path
from typing import Any

PHASES = ("startup", "data", "forward", "backward", "optimizer", "collective", "eval", "checkpoint", "done",
          "failed")
WAIT_PHASES = frozenset({"collective"})
LIVE_BYTES = 256
FILE_BYTES = 1024
LINE = re.compile(r"HB (\d+) (-?\d+) ([a-z]+) (\d+\.\d+) ([0-9a-f]{8})(?: (.*))?")


def heartbeat_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / "heartbeat" / f"rank{rank:05d}.hb"


class Heartbeat:
    """This rank's live position. run_dir None keeps it in memory only (tests, tools without a run directory).

    `device_clock` (optional) is told of every change between computing and waiting (mark(waiting)), for
    devices whose work the host's clock does not see (CUDA events: hpctrain.stragglers.CudaClock)."""

    def __init__(self, run_dir: str | os.PathLike | None, rank: int, facts: dict[str, Any] | None = None,
                 device_clock: Any = None) -> None:
        self.rank = rank
        self.step = 0
        self.phase, self.detail = "startup", ""
        self.since = time.monotonic()  # when the current phase began (the watchdog's clock)
        self.wall = time.time()  # the same moment on the wall clock (written out; comparable across hosts)
        self.changes = 0
        self.times = [0.0, 0.0]  # seconds computing, waiting: since the last take_times()
        self.device_clock = device_clock
        self._mm: mmap.mmap | None = None
        self.facts = dict(facts or {}, rank=rank, pid=os.getpid(), started=round(self.wall, 3))
        self.path = None if run_dir is None else heartbeat_path(run_dir, rank)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
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
        room = FILE_BYTES - LIVE_BYTES - 1
        if len(static) > room:  # a long error message: shorten the strings
            short = {k: v[:60] if isinstance(v, str) else v for k, v in self.facts.items()}
            static = json.dumps(short, sort_keys=True, ensure_ascii=True).encode()
        if len(static) > room:
            raise ValueError(f"heartbeat facts of rank {self.rank} take {len(static)} bytes, more than {room}")
        self._mm[LIVE_BYTES:] = static.ljust(room) + b"\n"

    def enter(self, phase: str, detail: str = "") -> None:
        """The rank begins `phase` now (one of PHASES; detail says more, e.g. which collective on which group)."""
        now = time.monotonic()
        was_waiting = self.phase in WAIT_PHASES
        self.times[was_waiting] += now - self.since
        waiting = phase in WAIT_PHASES
        if self.device_clock is not None and waiting != was_waiting:
            self.device_clock.mark(waiting)
        self.phase, self.detail, self.since, self.wall = phase, detail, now, time.time()
        self._write()

    def begin_step(self, step: int) -> None:
        """The step being worked on from now: its phases, and the checks and saves after it, carry its number
        (start-up carries the step training resumes after)."""
        self.step = step
        self._write()

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
        detail = self.detail.encode("ascii", "replace")[:160]
        body = b"%d %d %s %.3f" % (self.changes, self.step, self.phase.encode(), self.wall)
        line = b"HB %s %08x %s" % (body, zlib.crc32(body + b" " + detail), detail)
        self._mm[:LIVE_BYTES] = line.ljust(LIVE_BYTES - 1) + b"\n"

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


def read(path: str | os.PathLike) -> dict[str, Any]:
    """One heartbeat file: {"rank", "pid", "host", ..., "step", "phase", "detail", "wall", "changes"}, or
    {"error": why} for a file that is not one (too big, torn, foreign). Never trusts the file."""
    p = Path(path)
    try:
        if p.is_symlink() or p.stat().st_size != FILE_BYTES:
            return {"error": f"{p.name}: not a {FILE_BYTES}-byte heartbeat file"}
        raw = p.read_bytes()
    except OSError as e:
        return {"error": f"{p.name}: {e.strerror or e}"}
    try:
        facts = json.loads(raw[LIVE_BYTES:].decode("ascii"))
        live = raw[:LIVE_BYTES].decode("ascii").rstrip()
    except (UnicodeDecodeError, ValueError):
        return {"error": f"{p.name}: unreadable"}
    if not isinstance(facts, dict) or not isinstance(facts.get("rank"), int):
        return {"error": f"{p.name}: its facts hold no rank"}
    m = LINE.fullmatch(live)
    if m is None:
        return {**facts, "error": f"{p.name}: no live line"}
    changes, step, phase, wall, crc, detail = m.groups(default="")
    body = f"{changes} {step} {phase} {wall}".encode()
    if zlib.crc32(body + b" " + detail.encode()) != int(crc, 16) or phase not in PHASES:
        return {**facts, "error": f"{p.name}: torn or damaged live line"}
    return {**facts, "step": int(step), "phase": phase, "detail": detail, "wall": float(wall),
            "changes": int(changes)}

