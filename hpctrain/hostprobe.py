"""What one host can say about itself for `hpctrain doctor`: the checkpoint directory's write+fsync and cold read
rate, free space, file system and Lustre striping; the software environment. No torch.distributed; the caller
(hpctrain/doctor.py) picks one rank per node.

    storage(Path("/lustre/ckpt"), 128 << 20, "n1")   # {"write_gbps", "read_gbps", "free_gb", "fs", ...}
    environment()                                                       # {"torch", "cuda", "nccl", "mpi", ...}
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

BLOCK = 4 << 20  # bytes per write and read call, as a checkpoint writer's large sequential I/O
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


def storage(directory: Path, nbytes: int, name: str, stall: Callable[[float], None] | None = None
            ) -> dict[str, Any]:
    """Write nbytes to a new file in `directory` and fsync it (the time a checkpoint shard takes to be durable),
    then read it back cold. The file's cached pages are dropped with
    posix_fadvise(DONTNEED) before the read (they are clean after the fsync); a file system that ignores the
    advice reports a cached read. stall(seconds) is the slowed-node test switch's hook (hpctrain/doctor.py)."""
    path = directory / f".hpctrain-doctor-{name}-{os.getpid()}"
    block = memoryview(os.urandom(min(BLOCK, nbytes)))  # incompressible: a compressing file system must not flatter it
    buf = bytearray(len(block))
    fs = file_system(directory)
    try:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for start in range(0, nbytes, len(block)):
                os.write(fd, block[:nbytes - start])  # the last block may be short
            os.fsync(fd)
        finally:
            os.close(fd)
        write = nbytes / stalled(time.perf_counter() - t0, stall) / 1e9
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            while os.readv(fd, [buf]):
                pass
        finally:
            os.close(fd)
        read = nbytes / stalled(time.perf_counter() - t0, stall) / 1e9
        free = shutil.disk_usage(directory).free
    except OSError as e:
        return {"dir": str(directory), "error": f"cannot write and read back {path}: {e.strerror or e}"}
    finally:
        path.unlink(missing_ok=True)
    return {"dir": str(directory), "write_gbps": write, "read_gbps": read, "bytes": nbytes,
            "free_gb": free / 1e9, "fs": fs, "striping": striping(directory, fs)}


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
