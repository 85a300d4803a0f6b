"""Open files one rank of a job holds, counted from its layout before submission: pure arithmetic, no torch.

    need = estimate(Job(world_size=512, tasks_per_node=8, pp=1, dp=64, tp=8, nccl=True, async_save=True))
    need.total(0), need.total(1)      # rank 0 (it gathers: the largest), any other rank
    lines = check(cfg, layout)  # the dry run's lines; ValueError past job.nofile (or this host's hard limit)

Every row is an upper bound for one rank, counted from how each part opens descriptors:
- rendezvous store (torch's TCPStore): rank 0 listens, holds one connection per rank (its own client's included),
  its own client, and the server loop's 2 (io_uring or epoll, and an eventfd); every other rank one connection.
  Each rank's hang watchdog holds a second client (hpctrain/hang/watchdog.py): one more connection per rank on rank 0.
- gloo, per group the rank is in (the world, each mesh axis, the asynchronous-save group; every group serves host
  tensors through gloo, see hpctrain/job/rendezvous.py): 4 for the group's transport (a listening socket, an epoll
  and its wake-up pipe's two ends: gloo/transport/tcp/device.cc, loop.cc), plus one TCP connection per peer it has
  exchanged with. Pairs connect on their first message (rendezvous.lazy_gloo): rank 0 gathers on the world and
  async-save groups (checkpoint planning, object gathers), so it reaches every peer; any other rank reaches its ring
  neighbours (2), its dissemination-barrier partners (2 per doubling), its broadcast-tree parent and children
  (1 per doubling) and the gathering root: at most 3 * ceil(log2 n) + 3. A mesh axis counts every peer (small
  groups; a CPU job's all-to-alls run on them).
- NCCL, per communicator (the world and each mesh axis): the bootstrap's listening sockets for the ring and for
  peers (2), its ring connections (2), the proxy's listening socket (1), and proxy connections to and from the
  node's other ranks (2 per rank on the node) -- NCCL's src/bootstrap.cc and src/proxy.cc. The network transport's
  own handles (InfiniBand verbs, a socket transport's per-peer sockets) and the CUDA driver's are in the reserve.
- MPI (identity exchange, when the launch uses it): a broadcast tree and an all-gather, 2 * ceil(log2 n), and the
  process manager's connection.
- files: each token file stays mapped (1 each, validation files included), the heartbeat and the log (2), the
  checkpoint shard being written or read and the next one (2).
- reserve: stdio, the interpreter, shared libraries, torch's thread pipes, the CUDA driver and the network's own
  handles: a margin, not a count (GPU_RESERVE, CPU_RESERVE).

Which limit: each rank raises its soft limit to its hard limit at start (session.raise_open_files), so what counts
is the compute nodes' hard limit. The login node cannot see it: job.nofile names it; 0 takes this host's hard limit
and the dry run says it assumed so. Slurm hands tasks the submitting shell's soft limits (PropagateResourceLimits,
ALL by default), which is where the 1024 of many login nodes comes from.
"""
from __future__ import annotations

import math
import resource
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpctrain.config import Config
    from hpctrain.parallel.mesh import Layout

GLOO_TRANSPORT = 4  # per gloo group: listening socket, epoll, wake-up pipe (2)
STORE_SERVER = 4  # rank 0 beyond one connection per rank: listening socket, its own client, the loop's 2
NCCL_PER_COMM = 5  # bootstrap ring and peer listeners, ring send and receive, the proxy's listener
RUN_FILES = 2  # heartbeat, log
CKPT_FILES = 2  # the shard being written or read, the prefetched next
CPU_RESERVE = 64
GPU_RESERVE = 128


@dataclass(frozen=True)
class Job:
    """What the count depends on."""
    world_size: int
    tasks_per_node: int
    pp: int
    dp: int
    tp: int
    nccl: bool = False
    async_save: bool = False
    data_files: int = 0  # token files mapped by every rank (training and validation)
    mpi: bool = False  # identity exchanged over MPI


@dataclass
class Need:
    """Rows (what, rank 0's count, any other rank's count) and the sum per rank."""
    rows: list[tuple[str, int, int]] = field(default_factory=list)

    def add(self, what: str, rank0: int, other: int) -> None:
        self.rows.append((what, rank0, other))

    def total(self, rank: int) -> int:
        return sum(r0 if rank == 0 else other for _, r0, other in self.rows)


def ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def log2ceil(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def peers(n: int, gathers: bool) -> int:
    """gloo connections of one rank in a group of n: every peer for the rank that gathers, else what the ring,
    the barrier, the broadcast tree and the gathering root reach."""
    return n - 1 if gathers else min(n - 1, 3 * log2ceil(n) + 3)


def estimate(job: Job) -> Need:
    """Upper bounds of the descriptors rank 0 and any other rank hold (see the module docstring)."""
    w = job.world_size
    need = Need()
    need.add("rendezvous store", w + STORE_SERVER, 1)
    # every rank's hang watchdog has a store client of its own (its calls must not wait behind the main thread's)
    need.add("hang watchdog's store client", w, 1)
    if job.mpi:
        need.add("MPI (identity exchange)", 2 * log2ceil(w) + 1, 2 * log2ceil(w) + 1)
    need.add(f"gloo world ({ranks(w)})", GLOO_TRANSPORT + peers(w, True), GLOO_TRANSPORT + peers(w, False))
    if job.async_save:
        need.add(f"gloo asynchronous saves ({ranks(w)})", GLOO_TRANSPORT + peers(w, True),
                 GLOO_TRANSPORT + peers(w, False))
    for axis in ("pp", "dp", "tp"):
        n = getattr(job, axis)
        if n == w:  # torch's DeviceMesh reuses the world group for an axis that spans it
            continue
        need.add(f"gloo {axis} ({ranks(n)})", GLOO_TRANSPORT + n - 1, GLOO_TRANSPORT + n - 1)
    if job.nccl:
        comms = 1 + sum(getattr(job, axis) != w for axis in ("pp", "dp", "tp"))
        each = NCCL_PER_COMM + 2 * job.tasks_per_node
        need.add(f"NCCL ({comms} communicators)", comms * each, comms * each)
    if job.data_files:
        need.add("token files", job.data_files, job.data_files)
    need.add("heartbeat, log, checkpoint shards", RUN_FILES + CKPT_FILES, RUN_FILES + CKPT_FILES)
    reserve = GPU_RESERVE if job.nccl else CPU_RESERVE
    need.add("reserve (interpreter, libraries, drivers)", reserve, reserve)
    return need


def job_of(cfg: Config, layout: Layout) -> Job:
    """The Job of a config and its resolved layout."""
    files = len(cfg.data.files)
    if cfg.train.eval_every and cfg.data.source != "synthetic":
        files += 1 if cfg.data.val_path else len(cfg.data.files)  # "" : one beside each training file
    nccl = cfg.parallel.backend == "nccl" or (cfg.parallel.backend == "auto" and cfg.job.gpus_per_node > 0)
    return Job(world_size=layout.world_size, tasks_per_node=cfg.job.tasks_per_node, pp=layout.pp, dp=layout.dp,
               tp=layout.tp, nccl=nccl, async_save=cfg.checkpoint.async_save, data_files=files,
               mpi=cfg.parallel.rendezvous == "mpi" or (cfg.parallel.rendezvous == "auto" and cfg.job.mpi != ""))


def hard_limit() -> int:
    """This process's hard limit on open files (sys.maxsize when unlimited)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return sys.maxsize if hard == resource.RLIM_INFINITY else hard


def check(cfg: Config, layout: Layout, host_hard_limit: int | None = None) -> list[str]:
    """The dry run's table of open files per rank against the limit the ranks will run under: job.nofile, or when
    it is 0 host_hard_limit (default: this host's hard limit). ValueError naming the numbers and the fixes when
    rank 0 would pass it."""
    if host_hard_limit is None:
        host_hard_limit = hard_limit()
    job = job_of(cfg, layout)
    need = estimate(job)
    if cfg.job.nofile:
        limit, said = cfg.job.nofile, f"job.nofile = {cfg.job.nofile}"
    else:
        limit, said = host_hard_limit, (f"job.nofile unset: this host's hard limit {host_hard_limit}, assumed to be "
                                        f"the compute nodes' (set job.nofile to their `ulimit -Hn`)")
    top = need.total(0)
    width = max(len(what) for what, _, _ in need.rows)
    lines = [f"open files per rank (upper bounds, hpctrain/planner/fds.py): rank 0 {top}, any other rank "
             f"{need.total(1)}",
             f"  limit: {said}; each rank raises its soft limit to its hard limit at start",
             f"  {'':{width}}  {'rank 0':>7}  {'others':>7}"]
    lines += [f"  {what:{width}}  {r0:>7}  {other:>7}" for what, r0, other in need.rows]
    if top > limit:
        fixes = [f"raise the compute nodes' hard limit (`ulimit -Hn` there) to at least {top} and set job.nofile "
                 f"to it"]
        if job.async_save:
            saved = dict((what, r0) for what, r0, _ in need.rows)[f"gloo asynchronous saves ({ranks(job.world_size)})"]
            fixes.append(f"set checkpoint.async_save = false ({saved} fewer on rank 0)")
        fixes.append("or run fewer ranks")
        raise ValueError(f"rank 0 of this layout ({layout}, {job.world_size} ranks) may need {top} open files, more "
                         f"than the limit its ranks run under ({said}): " + "; ".join(fixes) + "\n" + "\n".join(lines))
    return lines
