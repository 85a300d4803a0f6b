"""One writer per checkpoint directory: a lock file <root>/LOCK.json that rank 0 holds for the whole run.

    with acquire(root) as lock:     # CheckpointDirLocked names the holder when another job uses root
        ...                         # or lock = acquire(root) ... lock.release()

The primitive is an O_EXCL create, which works on local disks, Lustre and NFSv3+ (flock may not). A lock left
behind is taken over only when its holder is provably gone: its pid is dead on this host, it is an earlier
incarnation of this requeued Slurm job, or squeue says its job has ended. On any doubt (no squeue, a timeout, an
unreadable record) acquire refuses and says how to clear the lock by hand. Tests: pytest
tests/pure/checkpoint/test_ckpt_lock.py
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from datetime import datetime
from pathlib import Path

from hpctrain.fsutil import write_atomic
from hpctrain.untrusted import parse_json

log = logging.getLogger(__name__)

NAME = "LOCK.json"
MAX_BYTES = 64 * 1024
ATTEMPTS = 8
SQUEUE_TIMEOUT = 5.0  # seconds
# squeue states after which a job's processes are gone for good. Any other state may still write (RUNNING,
# COMPLETING, CONFIGURING, SUSPENDED, STOPPED, RESIZING, SIGNALING, STAGE_OUT), or will run again and want its lock
# back (PENDING, REQUEUED, SPECIAL_EXIT), or is one Slurm adds later: all of those count as live.
ENDED = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "REVOKED", "TIMEOUT"}
_FIELDS = {"host": str, "pid": int, "job_id": str, "restart": str, "started": str, "cluster": str}
_ADVICE = "two jobs writing one directory corrupt each other: wait for that job, or set checkpoint.dir to another " \
          "directory"


class CheckpointDirLocked(RuntimeError):
    """Another job holds the checkpoint directory, or may: its lock cannot be proven stale."""


def this_holder() -> dict:
    env = os.environ
    job_id = env.get("SLURM_JOB_ID", "")
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"  # the form squeue -j accepts
    return {"host": socket.gethostname(), "pid": os.getpid(), "job_id": job_id,
            "restart": env.get("SLURM_RESTART_COUNT", "0"), "cluster": env.get("SLURM_CLUSTER_NAME", ""),
            "started": datetime.now().astimezone().isoformat(timespec="seconds")}


class DirLock:
    def __init__(self, path: Path, holder: dict, data: bytes) -> None:
        self.path, self.holder, self._data = path, holder, data

    def release(self) -> None:
        """Removes the lock file only while it holds our record (a random token makes each one unique)."""
        now = _read(self.path)[0]
        if now == self._data:
            self.path.unlink(missing_ok=True)
        elif now is not None:
            log.warning("%s no longer holds our record (taken over?); leaving it in place", self.path)

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(root: Path, holder: dict | None = None) -> DirLock:
    root, me = Path(root), {**this_holder(), **(holder or {}), "token": secrets.token_hex(8)}
    path, data = root / NAME, json.dumps(me).encode()
    problem = f"has a lock file {path} that changed hands {ATTEMPTS} times while we tried to take it over"
    try:
        root.mkdir(parents=True, exist_ok=True)
        for attempt in range(ATTEMPTS):
            if _create(path, data):
                return DirLock(path, me, data)
            seen, uid = _read(path)
            if seen is None:
                continue  # released since our create
            try:
                rec = _parse(seen)
            except ValueError as e:  # or a holder between its create and its write: look again
                problem = f"has a lock file {path} that is not a valid holder record ({e}); if no job uses the " \
                          f"directory, remove that file"
                time.sleep(min(0.05 * 2 ** attempt, 1.0))
                continue
            doubt = _stale(rec, me, foreign=uid != os.getuid())
            if doubt is not None:
                who = f"job {rec['job_id']}" if rec["job_id"] else "a process outside Slurm"
                why = f"; it may have ended, but {doubt}: if no job uses the directory, remove {path}" if doubt else ""
                raise CheckpointDirLocked(f"checkpoint directory {root} is in use by {who} (host {rec['host']}, "
                                          f"pid {rec['pid']}, started {rec['started']}){why}; {_ADVICE}")
            # Takeover. Only the taker that creates the marker named after these bytes may replace them, in one
            # os.replace (fsutil.write_atomic): LOCK.json is never absent, so no fresh acquire slips in beside it.
            # The marker goes once those bytes are gone for good; a slower taker that creates it then finds other
            # bytes and starts over.
            # Windows left: a taker killed between marker and replace blocks takeovers of that lock until a person
            # removes both files (the error says which); a holder misjudged stale loses its lock (see _stale).
            marker = path.with_name(f"{NAME}.takeover-{hashlib.blake2b(seen, digest_size=8).hexdigest()}")
            if not _create(marker, data):
                problem = f"has a stale lock file {path} whose takeover by another process did not finish; if no " \
                          f"job uses the directory, remove {path} and {marker}"
                time.sleep(min(0.05 * 2 ** attempt, 1.0))
                continue
            try:
                if _read(path)[0] == seen:
                    write_atomic(path, data, mode=0o644, unique=True)  # one rename over the stale bytes
                    log.warning("took over the stale lock of %s: %s", root, seen.decode(errors="replace"))
                    return DirLock(path, me, data)
            finally:
                marker.unlink(missing_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"cannot lock checkpoint directory {root} ({path}): {e.strerror}") from e
    raise CheckpointDirLocked(f"checkpoint directory {root} {problem}; {_ADVICE}")


def _create(path: Path, data: bytes) -> bool:
    """Writes path with data unless it exists (False); fsynced, so the record survives a crash of this node."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        path.unlink(missing_ok=True)  # an empty lock would block everyone
        raise
    return True


def _read(path: Path) -> tuple[bytes, int] | tuple[None, None]:
    try:
        with open(path, "rb") as f:
            return f.read(MAX_BYTES + 1), os.fstat(f.fileno()).st_uid
    except FileNotFoundError:
        return None, None


def _parse(data: bytes) -> dict:
    if len(data) > MAX_BYTES:
        raise ValueError(f"over {MAX_BYTES} bytes")
    rec = parse_json(data, "the record")  # ValueError: not UTF-8 JSON, nested too deep, a lone surrogate
    if not isinstance(rec, dict):
        raise ValueError("not a JSON object")
    rec.setdefault("cluster", "")  # clusters without a name
    for key, kind in _FIELDS.items():
        value = rec.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or len(str(value)) > 256:
            raise ValueError(f"{key}: {value!r:.80}")
    if not 0 < rec["pid"] < 2**31:  # os.kill(0 or -n, 0) would probe a whole process group
        raise ValueError(f"pid: {rec['pid']}")
    return rec


def _stale(rec: dict, me: dict, foreign: bool) -> str | None:
    """None when the holder is provably gone; otherwise "" (alive) or why its staleness cannot be proven."""
    same_cluster = not (rec["cluster"] and me["cluster"] and rec["cluster"] != me["cluster"])
    if rec["host"] == me["host"]:
        try:
            os.kill(rec["pid"], 0)  # in our pid namespace: a container with its own under our hostname fools this
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # alive, another user's
    if rec["job_id"] == me["job_id"] != "" and same_cluster and rec["restart"] != me["restart"]:
        return None  # an earlier incarnation of this requeued job: Slurm ended its processes before the rerun
    if rec["host"] == me["host"]:
        return ""  # alive here; squeue cannot overrule a live pid
    if not rec["job_id"]:
        return f"it ran outside Slurm on host {rec['host']}, which only that host can check"
    if not same_cluster:
        return f"it ran on cluster {rec['cluster']} and squeue here asks cluster {me['cluster']}"
    if not re.fullmatch(r"\d+(_\d+)?", rec["job_id"]):
        return f"{rec['job_id']!r} is not a Slurm job id"
    if (exe := shutil.which("squeue")) is None:
        return "squeue is not on PATH to ask Slurm"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQUEUE_")}  # SQUEUE_USERS etc. would filter
    try:  # -t all: squeue hides SUSPENDED/STOPPED jobs otherwise; -a: and jobs in hidden partitions
        out = subprocess.run([exe, "-h", "-a", "-t", "all", "-o", "%T", "-j", rec["job_id"]], capture_output=True,
                             text=True, timeout=SQUEUE_TIMEOUT, stdin=subprocess.DEVNULL, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"squeue did not answer ({e})"
    if out.returncode and "Invalid job id" not in out.stderr:
        return f"squeue failed: {out.stderr.strip()[:200] or f'exit {out.returncode}'}"
    states = set(out.stdout.split()) if out.returncode == 0 else set()
    if not states and foreign:  # PrivateData=jobs hides other users' jobs as if they had ended
        return f"squeue does not list job {rec['job_id']} and the lock file belongs to another user"
    return None if states <= ENDED else ""  # nothing listed: ended and purged from the controller
