"""Who am I: one frozen identity per rank from MPI, Slurm, submitit's local executor, torchrun or nothing, then
torch.distributed on top of it.

    ident = identify(p.rendezvous)            # no torch.distributed yet; MPI if launched under MPI
    device = init_distributed(ident, p.backend, p.timeout_s, p.master_addr, rendezvous_dir,
                              interface=p.interface, connect_timeout_s=p.connect_timeout_s)   # p: cfg.parallel

Under MPI the ranks first check that MPI's world is the one the launcher started (check_mpi_world), agree on node
identity by gathering node names (`SLURMD_NODENAME` when Slurm runs several slurmd on one host, else the host
name), and rank 0 broadcasts a TCPStore address it has bound (on the mpich wheel, MPICH's network module is set to
OFI before MPI starts unless the user chose one: mpi_environment). Launchers without MPI hand out identity in
environment variables (tables below); rank 0 then publishes the store address in a file in rendezvous_dir, a
directory every rank sees (session.start passes the run directory when it is given, else
<job.run_root>/.rendezvous). torchrun brings its own MASTER_ADDR/MASTER_PORT; a single process needs no store.

Where the store listens, the refusal of a loopback address across hosts and the interface handed to NCCL and
gloo: hpctrain/job/netaddr.py. Ranks give up dialling the store after parallel.connect_timeout_s, naming address and
port, instead of waiting the collective timeout.

What the rendezvous exposes. Rank 0's TCPStore listens on that one address; the port is one the OS picks. The
address reaches the other ranks over MPI, or through that file, created with mode 0600 (fsutil.write_atomic) and
removed as soon as every rank has connected. Every key of the job lives under a random per-job secret
(PrefixStore, 128 bits, shared over MPI or inside that file), so a process that connects without it finds none
of the job's keys by their names, and a stale rank of another job or attempt cannot write into this one.
What remains: the store has no authentication. Anyone who can reach that address and port while the job runs can
connect, set unrelated keys, fill the store's memory or hold connections open (denial of service); and because
TCPStore answers list_keys to any client, a deliberate one can list every key, secret prefix included, then read
or overwrite the job's keys. gloo's and NCCL's own connections between ranks are unauthenticated too. Keep the
job's network private and choose the interface with parallel.interface or parallel.master_addr. torchrun
launches use torchrun's own store (MASTER_ADDR/MASTER_PORT, every interface) and are not covered.

Collectives on host tensors under NCCL. An NCCL group serves only CUDA tensors: a collective on a host tensor
raises "No backend type associated with device type cpu". hpctrain's control collectives hold host values (the
RNG table, checkpoint sizes and flags, rank 0's verdicts and every object collective), so an NCCL job's default
group is "cpu:gloo,cuda:nccl" (backend_config): host tensors go to gloo, CUDA tensors to NCCL, and every group made
from it (new_group without a backend, DeviceMesh axes, and under the eager init below split_group, whose
ProcessGroup::splitGroup splits each backend with its own options) inherits both. Chosen over moving every control
collective to the device because it removes the whole class of bug instead of relying on each present and future
call site; host values need no copy to the GPU and no stream sync to read back; and object collectives stay on
the host (torch picks a group's CPU backend when it has one), the same path CPU jobs take, so CPU tests exercise
it. The cost: a gloo context per group (TCP connections, host memory, an interface every rank reaches: gloo
follows GLOO_SOCKET_IFNAME), and a host collective is a TCP round trip, so per-step collectives (the preemption
poll) keep passing the rank's device and stay on NCCL. device_id is still passed for NCCL: the communicator
connects at init, on the bound GPU, and subgroups split from it. tests/multiproc/job/test_device_collectives.py checks
this on CPU, the NCCL path emulated on gloo by patching this module from outside (tests/plugins/seams.py).

gloo connects lazily (lazy_gloo): a pair of ranks opens its TCP connection on its first message, not every pair of
every group when the group is made. Eager gloo held one socket per peer per group on every rank (at 64 x 8 ranks
with asynchronous saves about 1.1k per rank, past the 1024 soft `nofile` limit many sites give jobs); lazily a rank
holds only the peers its collectives reach: ring neighbours, broadcast-tree and barrier partners (a few times
log2 of the group) and, for the rank that gathers (rank 0 of the world and async-save groups), every peer. An NCCL
job's mesh axes keep their gloo for host tensors (nothing to get wrong at a call site) and, since their host
collectives are rare, hold almost no connection. Chosen over NCCL-only axis groups: those would save only each
group's idle transport (4 descriptors) at the price of a "No backend type" error for any host tensor on an axis.
A connection problem between two ranks now shows at their first message (the group checks at start reach the
ring neighbours), not at group creation, and a peer that dies before a pair's first message can leave the other
waiting past gloo's timeout (pytorch/gloo issue 520): the hang watchdog (parallel.hang_timeout_s) ends such a job.
Groups split from an NCCL world (eager init) make their gloo part in C++ under the same setting; only a GPU run
can show their sockets. hpctrain/planner/fds.py counts what a layout needs.
"""
from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from hpctrain.fsutil import write_atomic
from hpctrain.job.netaddr import FIX, check_reachable, feed_socket_ifname, store_address
from hpctrain.untrusted import read_json

log = logging.getLogger(__name__)

# Variables whose presence says which launcher started this process, in order of precedence. torchrun comes
# first: its workers inherit everything the process that started torchrun had, so `srun torchrun` workers see
# Slurm's variables and, under an srun MPI plugin (pmi2, pmix, or a site's MpiDefault), PMI ones too, and
# `mpiexec torchrun` workers see MPI's; yet they are torchrun's ranks, not the MPI world's. MPI comes before Slurm
# because `srun --mpi=pmi2` tasks see both. A launcher is recognised when every variable of one of its marker sets
# is present. A stray MASTER_PORT in a job script is not enough for torchrun: it takes TORCHELASTIC_RUN_ID or the
# full env:// set.
LAUNCHER_MARKERS = {
    "torchrun": [("TORCHELASTIC_RUN_ID",), ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")],
    "mpi": [("PMI_RANK",), ("PMIX_RANK",), ("OMPI_COMM_WORLD_RANK",), ("MV2_COMM_WORLD_RANK",)],
    "submitit": [("SUBMITIT_LOCAL_JOB_ID",)],
    "slurm": [("SLURM_PROCID",)],
}

# Identity fields -> environment variable, per launcher: a launcher is a row of data, not a branch of code.
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
    num_hosts: int = 0  # distinct real hosts of the job's ranks when known (MPI gathers them), else 0


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


def identity_from_node_names(rank: int, names: list[str], launcher: str, job_id: str,
                             hosts: list[str] | None = None) -> Identity:
    """Identity from every rank's node name (and real host name): nodes numbered in order of their lowest rank."""
    order: list[str] = []
    for name in names:
        if name not in order:
            order.append(name)
    mine = names[rank]
    return Identity(rank=rank, world_size=len(names), local_rank=names[:rank].count(mine),
                    node_index=order.index(mine), node_name=mine, num_nodes=len(order),
                    launcher=launcher, job_id=job_id, host=socket.gethostname(), num_hosts=len(set(hosts or [])))


def mpich_wheel_libmpi(env=os.environ) -> Path | None:
    """The libmpi of the `mpich` wheel when mpi4py will load it, else None. mpi4py (4.x) looks for libmpi in the
    environment's lib/ first, where the wheel puts it, unless MPI4PY_LIBMPI names another library."""
    if env.get("MPI4PY_LIBMPI"):
        return None
    try:
        dist = importlib.metadata.distribution("mpich")
    except importlib.metadata.PackageNotFoundError:
        return None
    first = Path(sys.exec_prefix, "lib", "libmpi.so")
    for f in dist.files or []:
        path = Path(dist.locate_file(f))
        if path.name == first.name and path.resolve() == first.resolve():
            return path.resolve()
    return None


def mpi_environment(env=os.environ) -> dict[str, str]:
    """What to set in the environment before MPI starts, unless the user set it. The mpich wheel's default network
    module (UCX) publishes a long address through Slurm's PMI, and slurmstepd's pmi2 plugin now and then mis-parses
    such values: `MPI_Init` dies with "mpi/pmi2: value not properly terminated in client request", then a UCX
    address assertion (pmodels/mpich#7957, #6924; about 3 in 50 jobs under load here, the PMI-1 wire too). MPICH's
    OFI module over TCP publishes a 16-byte address instead, and hpctrain's MPI traffic is a few small control
    messages. Only for the wheel: a site's MPICH may have been built without OFI."""
    if "MPIR_CVAR_CH4_NETMOD" in env or mpich_wheel_libmpi(env) is None:
        return {}
    return {"MPIR_CVAR_CH4_NETMOD": "ofi"}


def _mpi_comm():
    if "mpi4py.MPI" not in sys.modules:  # MPICH reads its variables when MPI starts: at this import
        for var, value in mpi_environment().items():
            os.environ[var] = value
            log.info("%s=%s (the mpich wheel under hpctrain)", var, value)
    from mpi4py import MPI  # initialises MPI; imported only when launched under MPI
    return MPI.COMM_WORLD


def mpi_bcast(comm, obj):
    """comm.bcast from rank 0, then a barrier: every rank leaves the exchange together. MPI makes progress only
    inside MPI calls; a root that went on to torch with its send still queued would leave a peer in bcast for good
    (seen with MPICH's OFI/TCP module, which connects to a peer on first use)."""
    obj = comm.bcast(obj, root=0)
    comm.Barrier()
    return obj


# Where a launcher states how many ranks it started, checked against MPI's own count by identify().
WORLD_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def _slurm_started_ranks(env) -> bool:
    """Slurm itself started the MPI ranks (srun's PMI: PMI_JOBID "<job>.<step>", PMIX_NAMESPACE "slurm.pmix...",
    or no MPI launcher's variables at all), so SLURM_NTASKS counts them. mpiexec/mpirun inside an allocation
    start their proxies as a Slurm step: their ranks inherit its counts (mpiexec -n 4 in salloc -N2 -n4 sees
    SLURM_NTASKS=2)."""
    step = f"{env.get('SLURM_JOB_ID')}.{env.get('SLURM_STEP_ID')}"
    if env.get("PMI_JOBID") == step or env.get("PMIX_NAMESPACE", "").startswith("slurm"):
        return True
    mpi_vars = {v for markers in LAUNCHER_MARKERS["mpi"] for v in markers} | set(WORLD_SIZE_VARS)
    return not mpi_vars & set(env)


def check_mpi_world(mpi_size: int, env=os.environ) -> None:
    """Refuses an MPI world smaller or larger than the launcher started: an MPI that does not speak the process
    manager's interface (Open MPI 5 under srun --mpi=pmi2) makes every task rank 0 of 1, each training alone."""
    said = {v: env[v] for v in WORLD_SIZE_VARS if v in env}
    if "SLURM_NTASKS" in env and _slurm_started_ranks(env):
        said["SLURM_NTASKS"] = env["SLURM_NTASKS"]
    if any(n.strip() != str(mpi_size) for n in said.values()):
        counts = ", ".join(f"{v} = {n}" for v, n in said.items())
        raise ValueError(f"MPI started this process in a world of {mpi_size} rank(s), but the launcher started "
                         f"{counts}: this MPI does not speak the launcher's process-management interface, so the "
                         f"tasks do not find each other (e.g. srun --mpi=pmi2 with Open MPI 5, which has no PMI2). "
                         f"Launch with the srun MPI plugin your MPI speaks (`srun --mpi=list`; pmix for Open MPI): "
                         f'job.mpi = "pmix" under hpctrain submit, --mpi=pmix in your own srun line; or let Slurm '
                         f'hand out identity without MPI: parallel.rendezvous = "slurm"')


def identify(rendezvous: str = "auto") -> Identity:
    """Works out this process's identity without touching torch.distributed."""
    launcher = detect_launcher() if rendezvous == "auto" else rendezvous
    if launcher == "mpi":
        comm = _mpi_comm()
        check_mpi_world(comm.Get_size())  # first: a lone task would pass every collective below
        names, hosts = zip(*comm.allgather((node_name(), socket.gethostname())))
        job_id = mpi_bcast(comm, _job_id(os.environ))  # outside Slurm each rank would name its own pid
        return identity_from_node_names(comm.Get_rank(), list(names), "mpi", job_id, list(hosts))
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
    """The rank's device, made current: the CPU without NCCL; else the GPU at local_rank modulo the GPUs this
    process sees. One GPU per task (srun --gpus-per-task=1 or --gpu-bind, CUDA_VISIBLE_DEVICES=3): cuda:0; every
    GPU of the node visible: cuda:<local rank>; a socket's GPUs shared by its tasks (--gpu-bind=closest, block
    distribution): the task's place among them. local_rank is LOCAL_RANK under torchrun (inside srun too),
    SLURM_LOCALID under srun, the rank's place on its node under MPI. More tasks than GPUs would share one,
    which NCCL refuses at init ("Duplicate GPU detected")."""
    import torch
    if backend != "nccl":
        return torch.device("cpu")
    dev = torch.device("cuda", ident.local_rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _listen(addr: str, source: str) -> socket.socket:
    """A listening socket bound to addr only (TCPStore itself would listen on every interface)."""
    try:
        family = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((addr, 0), family=family, backlog=1024)
    except OSError as e:
        raise ValueError(f"rank 0 cannot listen on {addr!r} ({source}): {e}; {FIX}") from None


def _connect(info: dict[str, Any], ident: Identity, timeout: timedelta, connect_timeout_s: int):
    """A client of rank 0's store, given up after connect_timeout_s with the address and port named; its later
    requests wait up to the collective timeout."""
    import torch.distributed as dist

    addr, port = info["addr"], info["port"]
    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:  # our own dialling: TCPStore's retries take up to twice its timeout and name no source
            socket.create_connection((addr, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            store = dist.TCPStore(addr, port, ident.world_size, is_master=False,
                                  timeout=timedelta(seconds=connect_timeout_s))
            break
        except (OSError, RuntimeError) as e:  # refused, unreachable, or no answer to the handshake
            if time.monotonic() >= deadline:
                raise TimeoutError(f"rank {ident.rank} on {ident.host}: cannot reach rank 0's rendezvous store at "
                                   f"{addr}:{port} ({info['source']}; rank 0 is on {info['host']}) within "
                                   f"parallel.connect_timeout_s = {connect_timeout_s} s: {e}; {FIX}") from None
            time.sleep(0.2)
    store.set_timeout(timeout)
    return store


def _rendezvous_file(ident: Identity, directory: Path) -> Path:
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
    step = os.environ.get("SLURM_STEP_ID", "0")
    return directory / f"rendezvous-{ident.launcher}-{ident.job_id}-{step}-{attempt}.json"


def _write_private(path: Path, text: str) -> None:
    """Writes path with mode 0600 from its creation (never wider, whatever the umask), through a rename: readers
    never see half a file."""
    write_atomic(path, text, mode=0o600, unique=True)


def _publish(ident: Identity, info: dict[str, Any] | None, directory: Path | None, timeout_s: int) -> dict:
    """Rank 0's store address and the job's secret to every rank: over MPI when we have it, else through a file
    only the job's user can read (removed by _admit once every rank has connected)."""
    if ident.launcher == "mpi":
        return mpi_bcast(_mpi_comm(), info)
    if directory is None:
        raise ValueError(f"launcher {ident.launcher!r} without MPI needs a shared run directory for rendezvous")
    path = _rendezvous_file(ident, directory)
    if ident.rank == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            _write_private(path, json.dumps(info))
        except OSError as e:  # e.g. job.run_root is a file: a clear error (the other ranks end with the launch)
            raise ValueError(f"cannot publish the rendezvous address in {directory} (under job.run_root): "
                             f"{e.strerror or e}") from None
        return info
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {ident.rank}: rank 0 did not publish {path} within {timeout_s} s")
        time.sleep(0.1)
    return _read_address(path)


_ADDRESS_FIELDS = {"addr": str, "port": int, "source": str, "host": str, "secret": str}


def _read_address(path: Path) -> dict[str, Any]:
    """Rank 0's publication, as read by another rank: a small JSON object of the expected fields and types (or
    rank 0's error), refused with a ValueError naming the file otherwise."""
    info = read_json(path, 1 << 16)
    if isinstance(info, dict) and set(info) == {"error"} and isinstance(info["error"], str):
        return info
    if not isinstance(info, dict) or not {"addr", "port", "secret"} <= set(info) <= set(_ADDRESS_FIELDS) or not all(
            type(info[k]) is _ADDRESS_FIELDS[k] for k in info) or not 0 < info["port"] < 65536:
        raise ValueError(f"{path}: not a rendezvous address published by rank 0 ({str(info)[:200]})")
    return info


def _admit(ident: Identity, store, directory: Path, timeout_s: int) -> None:
    """Every rank counts itself in; rank 0 waits for all, then removes the address file."""
    store.add("joined", 1)
    if ident.rank != 0:
        return
    path = _rendezvous_file(ident, directory)
    try:
        deadline = time.monotonic() + timeout_s
        while (joined := store.add("joined", 0)) < ident.world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {joined} of {ident.world_size} ranks reached the rendezvous store "
                                   f"within {timeout_s} s")
            time.sleep(0.02)
    finally:
        path.unlink(missing_ok=True)


def backend_config(backend: str) -> str:
    """What init_process_group gets: for NCCL, gloo beside it for host tensors ("cpu:gloo,cuda:nccl"; see the
    module docstring for why). Groups made from the default one (new_group, DeviceMesh) inherit both."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def lazy_gloo() -> None:
    """gloo groups made from here on connect a pair of ranks on its first message (see the module docstring); an
    explicit TORCH_GLOO_LAZY_INIT in the environment wins. torch reads it when it makes a gloo transport, so it
    is set before the first group."""
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")


def init_distributed(ident: Identity, backend: str = "auto", timeout_s: int = 600, master_addr: str = "",
                     rendezvous_dir: str | Path | None = None, *, interface: str = "", connect_timeout_s: int = 60,
                     flight_recorder: int = 0):
    """Starts torch.distributed for this identity and returns the rank's device. flight_recorder: entries of
    torch's flight recorder (every group's recent collectives, for hang dumps), unless the environment sets its
    size already (TORCH_FR_BUFFER_SIZE, or NCCL's older TORCH_NCCL_TRACE_BUFFER_SIZE)."""
    if flight_recorder and not {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"} & set(os.environ):
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(flight_recorder)  # read when a process group is made
    import torch.distributed as dist

    backend = choose_backend(backend)
    device = bind_device(ident, backend)
    timeout = timedelta(seconds=timeout_s)
    config = backend_config(backend)
    lazy_gloo()
    kwargs: dict[str, Any] = {"backend": config, "rank": ident.rank, "world_size": ident.world_size,
                              "timeout": timeout}
    if backend == "nccl":
        kwargs["device_id"] = device
    spans_hosts = ident.num_hosts > 1 if ident.num_hosts else ident.num_nodes > 1
    for var, value in feed_socket_ifname(interface, spans_hosts).items():
        log.info("rank %d: %s=%s", ident.rank, var, value)
    if ident.launcher == "torchrun":
        dist.init_process_group(init_method="env://", **kwargs)
        return device
    if ident.world_size == 1:
        dist.init_process_group(store=dist.HashStore(), **kwargs)
        return device
    store = None
    info = None
    if ident.rank == 0:
        try:  # a refusal reaches every rank through the publication, so none waits for an address
            addr, source = store_address(spans_hosts, master_addr, interface, ident.num_hosts)
            sock = _listen(addr, source)
        except ValueError as e:
            info = {"error": str(e)}
        else:  # port 0: the OS picks a free one; wait_for_workers=False or we would block before publishing it
            store = dist.TCPStore(addr, sock.getsockname()[1], ident.world_size, is_master=True, timeout=timeout,
                                  wait_for_workers=False, master_listen_fd=sock.detach())
            info = {"addr": addr, "port": store.port, "source": source, "host": ident.host,
                    "secret": secrets.token_hex(16)}
    rdzv_dir = Path(rendezvous_dir) if rendezvous_dir else None
    info = _publish(ident, info, rdzv_dir, timeout_s)
    if "error" in info:
        raise ValueError(info["error"])
    if ident.rank != 0:
        check_reachable(info, ident.rank, ident.host)
        store = _connect(info, ident, timeout, connect_timeout_s)
    log.info("rank %d: store at %s:%s (%s, %s), backend %s", ident.rank, info["addr"], info["port"],
             info["source"], ident.launcher, backend)
    # every key of the job under its secret: a client that connects without it finds none of them by name
    store = dist.PrefixStore(info["secret"], store)
    if ident.launcher != "mpi":
        _admit(ident, store, rdzv_dir, timeout_s)
    dist.init_process_group(store=store, **kwargs)
    return device
