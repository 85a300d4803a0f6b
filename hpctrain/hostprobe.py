"""What one host can say about itself for `hpctrain doctor`: the checkpoint directory's write+fsync and cold read
rate, free space, file system and Lustre striping; the software environment. No torch.distributed; the caller
(hpctrain/doctor.py) picks one rank per node.

    storage(Path("/lustre/ckpt"), 128 << 20, "n1")  # {"write_gbps", "read_gbps", "free_gb", "fs", ...}
    probe_bytes(128 << 20, free, writers=4)         # what it writes: bounded by a share of the free space
    environment()                                   # {"torch", "cuda", "nccl", "mpi", ...}
"""
from __future__ import annotations

import contextlib
import os
import platform
import re
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

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


def probe_dir(configured: str, run_dir: Path) -> Path:
    """The directory a job's checkpoints would go to (checkpoint.dir, else the run directory's file system), or the
    nearest existing directory above it: the probe creates nothing a later job would find."""
    path = Path(configured).absolute() if configured else run_dir
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return path


def file_system(path: Path) -> str:
    """The type of the mount holding path (ext4, xfs, nfs4, lustre, ...), from /proc/mounts; "?" elsewhere."""
    real, best, kind = str(path.resolve()), "", "?"
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])  # a space is \040 there
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind


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


def storage(directory: Path, nbytes: int, name: str, stall: Callable[[float], None] | None = None,
            writers: int = 1) -> dict[str, Any]:
    """Write nbytes to a new file in `directory` and fsync it (the time a checkpoint shard takes to be durable),
    then read it back cold. nbytes is bounded by the free space (probe_bytes; the result says when it shrank).
    The file is unlinked as soon as it is created, before the first byte: its blocks go back to the file system
    when this process closes it or ends, by any signal, SIGKILL included. Its cached pages are dropped with
    posix_fadvise(DONTNEED) before the read (they are clean after the fsync); a file system that ignores the
    advice reports a cached read. stall(seconds) is the slowed-node test switch's hook (hpctrain/doctor.py)."""
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
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        return {"dir": str(directory), "error": f"cannot create {path}: {e.strerror or e}"}
    try:
        os.unlink(path)
        t0 = time.perf_counter()
        done = 0
        while done < nbytes:
            done += os.write(fd, block[:nbytes - done])  # the last block may be short; so may any write
        os.fsync(fd)
        write = nbytes / stalled(time.perf_counter() - t0, stall) / 1e9
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.perf_counter()
        while os.readv(fd, [buf]):
            pass
        read = nbytes / stalled(time.perf_counter() - t0, stall) / 1e9
    except OSError as e:
        return {"dir": str(directory), "error": f"cannot write and read back {path}: {e.strerror or e}"}
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):  # a file system that refused to unlink an open file may take it now
            path.unlink(missing_ok=True)
    out = {"dir": str(directory), "write_gbps": write, "read_gbps": read, "bytes": nbytes, "free_gb": free / 1e9,
           "fs": fs, "striping": striping(directory, fs)}
    return out | ({"asked": asked, "shrunk": shrunk} if shrunk else {})


def stalled(elapsed: float, stall: Callable[[float], None] | None) -> float:
    """The span as measured, plus what the stall hook adds to it (it sleeps, so it is real time too)."""
    if stall is None:
        return elapsed
    t0 = time.perf_counter()
    stall(elapsed)
    return elapsed + time.perf_counter() - t0


def environment() -> dict[str, Any]:
    """Versions of the stack and the communication variables of this process: what must agree across nodes."""
    import torch

    nccl = None
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    mpi = None
    from hpctrain import ending
    if ending.mpi_running():  # importing mpi4py would start MPI: only report one that runs
        from mpi4py import MPI
        mpi = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    env = os.environ
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": nccl, "mpi": mpi,
            "vars": {k: env[k] for k in sorted(env) if k.startswith(COMPARED_PREFIXES)},
            "shown": {k: env[k] for k in SHOWN if k in env}}
