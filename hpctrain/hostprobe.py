"""What one host can say about itself for `hpctrain doctor`: the checkpoint directory's write+fsync and cold read
rate, free space, file system and Lustre striping; the software environment. No torch.distributed; the caller
(hpctrain/doctor/measure.py) picks one rank per node. Also what the dry run and the checkpoint manager ask of a
directory: its file system (NFS?) and the quota left on it.

    storage(Path("/lustre/ckpt"), 128 << 20, "n1")  # {"write_gbps", "read_gbps", "free_gb", "fs", ...}
    probe_bytes(128 << 20, free, writers=4)         # what it writes: bounded by a share of the free space
    environment()                                   # {"torch", "cuda", "nccl", "mpi", ...}
    quota_left(Path("/lustre/ckpt"))                # (bytes, "the Lustre user quota ...") or None
    nfs_warning("job.run_root", path, mount_table(), home, scratch)    # str or None
    room_warning("checkpoint.dir", path, ckpt_bytes, keep, free, quota)  # str or None

Tests: pytest tests/pure/doctor/test_doctor_probe.py tests/pure/job/test_storage_warnings.py
"""
from __future__ import annotations

import contextlib
import errno
import os
import platform
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BLOCK = 4 << 20  # bytes per write and read call, as a checkpoint writer's large sequential I/O
# The storage probe's bounds. MAX_STORAGE_MB: the most `doctor --storage-mb` takes (16 GiB; a rate measured past a
# few GiB no longer changes, and each of the rounds writes it again). FREE_SHARE: whatever was asked, a node writes
# at most this share of the free space it sees (the nodes writing at once split it), so that a probe can never
# fill a file system that others share.
MAX_STORAGE_MB = 16 << 10
FREE_SHARE = 0.1
# communication settings that must agree across nodes (NCCL, its plugins, libfabric, UCX, gloo, MPICH);
# CUDA_VISIBLE_DEVICES and OMP_NUM_THREADS are shown but may differ per rank
COMPARED_PREFIXES = ("NCCL_", "TORCH_NCCL_", "FI_", "UCX_", "GLOO_", "MPIR_CVAR_")
SHOWN = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")


def mpi_running() -> bool:
    """MPI was started in this process (identify() under MPI) and is not finalized yet."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()


def probe_dir(configured: str, run_dir: Path) -> Path:
    """The directory a job's checkpoints would go to (checkpoint.dir, else the run directory's file system), or the
    nearest existing directory above it: the probe creates nothing a later job would find."""
    path = Path(configured).absolute() if configured else run_dir
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return path


def mount_table() -> str:
    """/proc/mounts as text; "" where there is none."""
    try:
        return Path("/proc/mounts").read_text()
    except OSError:
        return ""


def mount_of(path: Path, table: str) -> tuple[str, str]:
    """(mount point, type) of the mount holding path in a /proc/mounts table (the longest mount point above it, the
    last mounted of equals); ("", "?") when none does. The path need not exist yet."""
    real, best, kind = str(Path(path).resolve()), "", "?"
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])  # a space is \040 there
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return best, kind


def file_system(path: Path) -> str:
    """The type of the mount holding path (ext4, xfs, nfs4, lustre, ...), from /proc/mounts; "?" elsewhere."""
    return mount_of(path, mount_table())[1]


def striping(path: Path, fs: str) -> str:
    """Lustre's default striping of the directory (`lfs getstripe -d`), or why there is none to show."""
    if fs != "lustre":
        return f"not Lustre ({fs})"
    if shutil.which("lfs") is None:
        return "Lustre, no lfs on PATH"
    try:
        out = subprocess.run(["lfs", "getstripe", "-d", str(path)], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"lfs getstripe failed: {e}"
    text = " ".join((out.stdout or out.stderr).split())
    return f"lfs getstripe -d: {text}" if out.returncode == 0 else f"lfs getstripe failed: {text}"


# `lfs quota` asks the metadata server and every OST: seconds on a busy file system, never worth a stalled save
QUOTA_TIMEOUT_S = 20


def lfs_quota_left(text: str) -> int | None:
    """Bytes left under the block limit in `lfs quota -q` output: the file system (alone on its line when long), then
    kbytes used (a '*' marks usage past a limit), the soft limit, the hard limit, the grace, then the same for files.
    The hard limit counts (writes fail there), else the soft one; None where neither is set or the text is not
    that."""
    fields = text.split()
    try:
        used, soft, hard = (int(f.rstrip("*")) for f in fields[1:4])
    except ValueError:
        return None
    limit = hard or soft
    return max(0, limit - used) << 10 if limit > 0 else None


def quota_left(path: Path) -> tuple[int, str] | None:
    """(bytes, which quota) still allowed on path's file system, the least of this user's and the directory group's
    Lustre block quotas (`lfs quota`), when path is on Lustre and lfs is on PATH; None otherwise, or with no limit,
    or when lfs fails. Other quotas (NFS's rquota, GPFS's mmlsquota) are not asked: there the write's own EDQUOT
    is the check (checkpoint/manager.py)."""
    path = probe_dir(str(path), Path(path))
    if file_system(path) != "lustre" or shutil.which("lfs") is None:
        return None
    best = None
    for flag, ident, whose in (("-u", os.getuid(), "user"), ("-g", path.stat().st_gid, "group")):
        try:
            out = subprocess.run(["lfs", "quota", "-q", flag, str(ident), str(path)], capture_output=True, text=True,
                                 timeout=QUOTA_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            continue
        left = lfs_quota_left(out.stdout) if out.returncode == 0 else None
        if left is not None and (best is None or left < best[0]):
            best = (left, f"the Lustre {whose} quota (lfs quota {flag} {ident})")
    return best


NFS = ("nfs", "nfs4")  # /proc/mounts types: NFS v2/v3 and v4


def nfs_warning(key: str, path: Path, table: str, home: str = "", scratch: str = "") -> str | None:
    """A warning when path, the value of config key `key`, lies on NFS (by the mount table `table`), most often a
    home directory: a small quota that checkpoints fill, slow large writes, and attribute caching (30-60 s) that
    shows one node's new files to the others late. None elsewhere."""
    mount, kind = mount_of(path, table)
    if kind not in NFS:
        return None
    real = Path(path).resolve()
    at_home = bool(home) and (real == Path(home).resolve() or Path(home).resolve() in real.parents)
    instead = f"$SCRATCH ({scratch})" if scratch else "a scratch or Lustre file system (e.g. under $SCRATCH)"
    return (f"warning: {key} = {str(path)!r} is on {'an NFS home directory' if at_home else 'NFS'} ({kind} at "
            f"{mount}): checkpoints there fill a small quota and write slowly, and NFS shows files one node writes "
            f"to the others up to a minute late; put {key} on {instead}")


def room_warning(key: str, path: Path, ckpt_bytes: int, keep: int, free: int,
                 quota: tuple[int, str] | None) -> str | None:
    """A warning when the directory checkpoints go to (path, named by config key `key`) has room, by its free space
    or its quota, for fewer than checkpoint.keep + 1 checkpoints of ckpt_bytes (the kept ones and the one being
    written); None when they fit."""
    need = (keep + 1) * ckpt_bytes
    left, what = min([(free, "its free space"), *([quota] if quota else [])])
    if left >= need:
        return None
    fix = "ask for more quota or put checkpoint.dir on scratch" if quota and left == quota[0] else \
        "put checkpoint.dir on a larger file system (scratch, Lustre)"
    return (f"warning: {key} = {str(path)!r}: {what} leaves {left / 1e9:.3g} GB, less than checkpoint.keep + 1 = "
            f"{keep + 1} checkpoints of about {ckpt_bytes / 1e9:.3g} GB; once it runs out periodic saves are skipped "
            f"and the final save fails the job: {fix}")


def probe_bytes(asked: int, free: int, writers: int) -> tuple[int, str | None]:
    """How much one node's storage probe writes: `asked`, or less where that is more than FREE_SHARE of the free
    space divided between the `writers` nodes that write at the same moment (they may all write to one parallel
    file system, each seeing the same free space), in whole blocks. (bytes, why it was shrunk or None); 0 bytes:
    too little room to probe."""
    room = int(free * FREE_SHARE) // max(1, writers) // BLOCK * BLOCK
    if asked <= room:
        return asked, None
    return room, (f"probe shrunk from {asked >> 20} to {room >> 20} MiB: at most {FREE_SHARE:.0%} of the "
                  f"{free / 1e9:.3g} GB free, shared by {writers} node(s) writing at once")


def unnamed_file(directory: Path) -> int:
    """A new file in `directory` that has no name at any moment (O_TMPFILE, O_EXCL: it can never be linked in),
    open for reading and writing; -1 where the kernel or the file system makes none (another system, an older
    kernel: EISDIR; a file system without it: EOPNOTSUPP). Any other refusal (EACCES, ENOSPC) raises."""
    flag = getattr(os, "O_TMPFILE", 0)
    if not flag:
        return -1
    try:
        return os.open(directory, os.O_RDWR | flag | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return -1
        raise


def storage(directory: Path, nbytes: int, name: str, writers: int = 1) -> dict[str, Any]:
    """Write nbytes to a new file in `directory` and fsync it (the time a checkpoint shard takes to be durable),
    then read it back cold. nbytes is bounded by the free space (probe_bytes; the result says when it shrank).
    The file never has a name where the file system makes unnamed files (Linux's O_TMPFILE: ext4, xfs, tmpfs,
    btrfs among others); elsewhere it is unlinked as soon as it is created, before the first byte (a SIGKILL in the
    microseconds between the two leaves it, under a name no one else uses). Either way its blocks go back to the
    file system when this process closes it or ends, by any signal, SIGKILL included. Its cached pages are dropped
    with posix_fadvise(DONTNEED) before the read (they are clean after the fsync); a file system that ignores the
    advice reports a cached read."""
    fs = file_system(directory)
    try:
        free = shutil.disk_usage(directory).free
    except OSError as e:
        return {"dir": str(directory), "error": f"cannot read the free space of {directory}: {e.strerror or e}"}
    asked = nbytes
    nbytes, shrunk = probe_bytes(asked, free, writers)
    if not nbytes:
        return {"dir": str(directory), "error": f"{free / 1e9:.3g} GB free in {directory}: too little to probe "
                f"(at most {FREE_SHARE:.0%} of it, shared by {writers} node(s), in {BLOCK >> 20} MiB blocks)"}
    # a random part: a name planted in a shared directory is never opened (O_EXCL follows no link either)
    path = directory / f".hpctrain-doctor-{name}-{os.getpid()}-{secrets.token_hex(4)}"
    block = memoryview(os.urandom(min(BLOCK, nbytes)))  # incompressible: a compressing file system must not flatter it
    buf = bytearray(len(block))
    # without O_TMPFILE, until open says it made nothing, the name may be ours: a signal's handler can raise
    # (preempt.Ended) as open returns, before this frame holds the descriptor; the finally below removes the name
    # then too (it is unguessable, so it names no one else's file)
    fd, ours = -1, False
    try:
        try:
            fd = unnamed_file(directory)
        except OSError as e:
            return {"dir": str(directory), "error": f"cannot create a file in {directory}: {e.strerror or e}"}
        if fd < 0:
            ours = True
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except OSError as e:
                ours = False
                return {"dir": str(directory), "error": f"cannot create {path}: {e.strerror or e}"}
            os.unlink(path)
        t0 = time.perf_counter()
        done = 0
        while done < nbytes:
            done += os.write(fd, block[:nbytes - done])  # the last block may be short; so may any write
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - t0) / 1e9
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.perf_counter()
        while os.readv(fd, [buf]):
            pass
        read = nbytes / (time.perf_counter() - t0) / 1e9
    except OSError as e:
        return {"dir": str(directory), "error": f"cannot write and read back {path}: {e.strerror or e}"}
    finally:
        if fd >= 0:
            os.close(fd)
        if ours:
            with contextlib.suppress(OSError):  # a file system that refused to unlink an open file may take it now
                path.unlink(missing_ok=True)
    out = {"dir": str(directory), "write_gbps": write, "read_gbps": read, "bytes": nbytes, "free_gb": free / 1e9,
           "fs": fs, "striping": striping(directory, fs)}
    return out | ({"asked": asked, "shrunk": shrunk} if shrunk else {})


def environment() -> dict[str, Any]:
    """Versions of the stack and the communication variables of this process: what must agree across nodes."""
    import torch

    nccl = None
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    mpi = None
    if mpi_running():  # importing mpi4py would start MPI: only report one that runs
        from mpi4py import MPI
        mpi = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    env = os.environ
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": nccl, "mpi": mpi,
            "vars": {k: env[k] for k in sorted(env) if k.startswith(COMPARED_PREFIXES)},
            "shown": {k: env[k] for k in SHOWN if k in env}}
