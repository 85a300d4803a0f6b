"""Who am I: one frozen identity per rank from MPI, Slurm, submitit's local executor, torchrun or nothing, then
torch.distributed on top of it.

    ident = identify(cfg.parallel)            # no torch.distributed yet; MPI if launched under MPI
    device = init_distributed(ident, cfg.parallel, rendezvous_dir)

Under MPI the ranks agree on node identity by gathering node names (`SLURMD_NODENAME` when Slurm runs several
slurmd on one host, else the host name), and rank 0 broadcasts a TCPStore address it has bound. Launchers without
MPI hand out identity in environment variables (tables below); rank 0 then publishes the store address in a file
under the shared run directory. torchrun brings its own MASTER_ADDR/MASTER_PORT.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Variables whose presence says which launcher started this process, in order of precedence. torchrun comes
# before Slurm because `srun torchrun` workers see both; MPI first because `srun --mpi=pmi2` tasks do too.
# A launcher is recognised when every variable of one of its marker sets is present. A stray MASTER_PORT in a
# job script is not enough for torchrun: it takes TORCHELASTIC_RUN_ID or the full env:// set.
LAUNCHER_MARKERS = {
    "mpi": [("PMI_RANK",), ("PMIX_RANK",), ("OMPI_COMM_WORLD_RANK",), ("MV2_COMM_WORLD_RANK",)],
    "torchrun": [("TORCHELASTIC_RUN_ID",), ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")],
    "submitit": [("SUBMITIT_LOCAL_JOB_ID",)],
    "slurm": [("SLURM_PROCID",)],
}

# Identity fields -> environment variable, per launcher (like submitit's JobEnvironment._env).
ENV_TABLES = {
    "slurm": {"rank": "SLURM_PROCID", "world_size": "SLURM_NTASKS", "local_rank": "SLURM_LOCALID",
              "node_index": "SLURM_NODEID", "num_nodes": "SLURM_NNODES", "job_id": "SLURM_JOB_ID"},
    "submitit": {"rank": "SUBMITIT_LOCAL_GLOBALID", "world_size": "SUBMITIT_LOCAL_NTASKS",
                 "local_rank": "SUBMITIT_LOCAL_LOCALID", "node_index": "SUBMITIT_LOCAL_NODEID",
                 "num_nodes": "SUBMITIT_LOCAL_JOB_NUM_NODES", "job_id": "SUBMITIT_LOCAL_JOB_ID"},
    "torchrun": {"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK",
                 "node_index": "GROUP_RANK", "local_world_size": "LOCAL_WORLD_SIZE", "job_id": "TORCHELASTIC_RUN_ID"},
}


@dataclass(frozen=True)
class Identity:
    rank: int
    world_size: int
    local_rank: int
    node_index: int
    node_name: str
    num_nodes: int
    launcher: str  # mpi | slurm | submitit | torchrun | single
    job_id: str
    host: str  # the real host name; several Slurm "nodes" may share one in tests


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def detect_launcher(env: dict[str, str] | os._Environ = os.environ) -> str:
    for launcher, marker_sets in LAUNCHER_MARKERS.items():
        if any(all(m in env for m in markers) for markers in marker_sets):
            return launcher
    return "single"


def _job_id(env) -> str:
    for key in ("SLURM_JOB_ID", "SUBMITIT_LOCAL_JOB_ID", "TORCHELASTIC_RUN_ID"):
        if key in env:
            return env[key]
    return f"pid{os.getpid()}"


def identity_from_env(launcher: str, env: dict[str, str] | os._Environ = os.environ) -> Identity:
    """Identity for launchers that export it; missing variables are named in the error."""
    table = ENV_TABLES[launcher]
    optional = {"job_id", "node_index"} if launcher == "torchrun" else {"job_id"}
    missing = [v for k, v in table.items() if k not in optional and v not in env]
    if missing:
        raise ValueError(f"launcher {launcher!r} detected but {', '.join(missing)} not set")
    val = {}
    for k, v in table.items():
        if k != "job_id" and v in env:
            try:
                val[k] = int(env[v])
            except ValueError:
                raise ValueError(f"{v} = {env[v]!r} is not an integer (launcher {launcher!r})") from None
    if launcher == "torchrun":  # torchrun gives ranks per node, not the node count
        val["num_nodes"] = val["world_size"] // val.pop("local_world_size")
        val.setdefault("node_index", val["rank"] // (val["world_size"] // val["num_nodes"]))
    return Identity(rank=val["rank"], world_size=val["world_size"], local_rank=val["local_rank"],
                    node_index=val["node_index"], node_name=node_name(), num_nodes=val["num_nodes"],
                    launcher=launcher, job_id=env.get(table["job_id"], _job_id(env)), host=socket.gethostname())


def identity_from_node_names(rank: int, names: list[str], launcher: str, job_id: str) -> Identity:
    """Identity from every rank's node name: nodes numbered in order of their lowest rank."""
    order: list[str] = []
    for name in names:
        if name not in order:
            order.append(name)
    mine = names[rank]
    return Identity(rank=rank, world_size=len(names), local_rank=names[:rank].count(mine),
                    node_index=order.index(mine), node_name=mine, num_nodes=len(order),
                    launcher=launcher, job_id=job_id, host=socket.gethostname())


def _mpi_comm():
    from mpi4py import MPI  # initialises MPI; imported only when launched under MPI
    return MPI.COMM_WORLD


def mpi_running() -> bool:
    """MPI was started in this process (identify() under MPI) and is not finalized yet."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()


def abort_launch(code: int = 1) -> None:
    """Ends every rank of this MPI launch now (MPI_Abort); returns without MPI.

    A failed rank must not exit normally under MPI: mpi4py's exit hook calls MPI_Finalize, which waits for peers
    that may be stuck in a collective or stopped, and the job would hold its nodes until the time limit."""
    if mpi_running():
        sys.stdout.flush()
        sys.stderr.flush()
        sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(code)


def identify(rendezvous: str = "auto") -> Identity:
    """Works out this process's identity without touching torch.distributed."""
    launcher = detect_launcher() if rendezvous == "auto" else rendezvous
    if launcher == "mpi":
        comm = _mpi_comm()
        names = comm.allgather(node_name())
        job_id = comm.bcast(_job_id(os.environ), root=0)  # outside Slurm each rank would name its own pid
        return identity_from_node_names(comm.Get_rank(), names, "mpi", job_id)
    if launcher == "single":
        return Identity(0, 1, 0, 0, node_name(), 1, "single", _job_id(os.environ), socket.gethostname())
    return identity_from_env(launcher)


def choose_backend(requested: str) -> str:
    import torch
    has_cuda = torch.cuda.is_available()
    if requested == "nccl" and not has_cuda:
        raise ValueError("parallel.backend = 'nccl' but no CUDA device is visible on this rank")
    if requested == "auto":
        return "nccl" if has_cuda else "gloo"
    return requested


def bind_device(ident: Identity, backend: str):
    """The rank's device: its local GPU for NCCL (local_rank modulo the visible GPUs), else the CPU."""
    import torch
    if backend != "nccl":
        return torch.device("cpu")
    dev = torch.device("cuda", ident.local_rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _my_address(ident: Identity, master_addr: str) -> dict[str, str]:
    if master_addr:
        return {"addr": master_addr, "host": ident.host}
    try:
        addr = socket.gethostbyname(socket.getfqdn())
    except OSError:
        addr = "127.0.0.1"
    return {"addr": addr, "host": ident.host}


def _connect_addr(published: dict[str, Any], ident: Identity) -> str:
    """Ranks on rank 0's own host use loopback; node names like n1 need not resolve."""
    return "127.0.0.1" if published["host"] == ident.host and not published.get("forced") else published["addr"]


def _rendezvous_file(ident: Identity, directory: Path) -> Path:
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
    step = os.environ.get("SLURM_STEP_ID", "0")
    return directory / f"rendezvous-{ident.launcher}-{ident.job_id}-{step}-{attempt}.json"


def _publish(ident: Identity, info: dict[str, Any] | None, directory: Path | None, timeout_s: int) -> dict:
    """Rank 0's store address to every rank: over MPI when we have it, else through a file."""
    if ident.launcher == "mpi":
        return _mpi_comm().bcast(info, root=0)
    if directory is None:
        raise ValueError(f"launcher {ident.launcher!r} without MPI needs a shared run directory for rendezvous")
    path = _rendezvous_file(ident, directory)
    if ident.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, path)  # atomic: readers never see half a file
        return info
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {ident.rank}: rank 0 did not publish {path} within {timeout_s} s")
        time.sleep(0.1)
    return json.loads(path.read_text())


def init_distributed(ident: Identity, backend: str = "auto", timeout_s: int = 600, master_addr: str = "",
                     rendezvous_dir: str | Path | None = None):
    """Starts torch.distributed for this identity and returns the rank's device."""
    import torch.distributed as dist

    backend = choose_backend(backend)
    device = bind_device(ident, backend)
    timeout = timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {"backend": backend, "rank": ident.rank, "world_size": ident.world_size,
                              "timeout": timeout}
    if backend == "nccl":
        kwargs["device_id"] = device
    if ident.launcher == "torchrun":
        dist.init_process_group(init_method="env://", **kwargs)
        return device
    if ident.world_size == 1:
        dist.init_process_group(store=dist.HashStore(), **kwargs)
        return device
    store = None
    info = None
    if ident.rank == 0:
        # Port 0: the OS picks a free port; wait_for_workers=False or we would block before publishing it.
        store = dist.TCPStore("0.0.0.0", 0, ident.world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        info = _my_address(ident, master_addr) | {"port": store.port, "forced": bool(master_addr)}
    info = _publish(ident, info, Path(rendezvous_dir) if rendezvous_dir else None, timeout_s)
    if ident.rank != 0:
        store = dist.TCPStore(_connect_addr(info, ident), info["port"], ident.world_size, is_master=False,
                              timeout=timeout)
    log.info("rank %d: store at %s:%s (%s), backend %s", ident.rank, info["addr"], info["port"], ident.launcher,
             backend)
    dist.init_process_group(store=store, **kwargs)
    return device
