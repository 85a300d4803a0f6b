"""Start and stop of every job's ranks: rendezvous, the run directory, the topology-checked mesh and its
checked all-reduce, and rank 0's summary.json. Payloads (training, benchmarks) run inside:

    with session.start(cfg, run_dir) as s:  # s.ident, s.device, s.plan, s.mesh, s.run_dir, s.summary, s.preempt
        s.summary["payload"] = do_work(s.mesh)

The session makes and configures the rank's hang watchdog (hpctrain/hang/watchdog.py) whole: its limits, peers,
store channel and what the first rank to trip does last (for a payload that resumes, start(..., resumes=True):
requeue the job without its silent nodes, job.node_requeues times, counted with the preflight's). The payload
only reports its progress through s.heartbeat (phases, steps, and begin_training: where the first step, with the
long limit, is).

s.preempt is the process's PreemptionFlag, installed before the rendezvous (the `train` command installs it even
earlier): a USR2/TERM during start-up waits there for the payload's first poll.

Before the rendezvous every rank raises its soft limit on open files to its hard limit (raise_open_files): Slurm
hands tasks the soft limits of the shell that submitted, often 1024 from a login node, while rank 0 holds a store
connection per rank and gloo connections to every peer of the world (hpctrain/planner/fds.py counts them). The
rank's log says when it raised the limit; summary.json keeps rank 0's ("open_files").

Every rank sees the same gathered identities, so a refused layout is refused on all ranks alike (no hang).
"""
from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from hpctrain.config import Config, dump_toml
from hpctrain.hang import ending
from hpctrain.hang.heartbeat import Heartbeat
from hpctrain.hang.watchdog import Limits, Peer, StoreChannel, Watchdog, keep_earlier_hang
from hpctrain.job import rendezvous, requeue, runs
from hpctrain.job.preempt import PreemptionFlag, process_flag
from hpctrain.parallel import mesh
from hpctrain.parallel.plan import Plan, make_plan

log = logging.getLogger(__name__)


@dataclass
class Session:
    cfg: Config
    ident: rendezvous.Identity
    device: torch.device
    run_dir: Path
    plan: Plan | None = None  # the job's layout and topology check (hpctrain.parallel.plan), made once at start
    mesh: mesh.Mesh | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    preempt: PreemptionFlag = field(default_factory=process_flag)  # poll it at step boundaries
    heartbeat: Heartbeat | None = None  # this rank's step and phase (RUN_DIR/heartbeat/): the payload enters phases
    watchdog: Watchdog | None = None  # None when parallel.hang_timeout_s = 0
    hosts: list[str] = field(default_factory=list)  # every rank's host (node name), by rank

    @property
    def rank(self) -> int:
        return self.ident.rank


def raise_open_files() -> dict[str, Any]:
    """Raises this process's soft RLIMIT_NOFILE to its hard limit (the most an unprivileged process may ask for).
    Returns {"soft_was", "soft", "hard"}, and "error" when the kernel refused (the limit stays as it was)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    out: dict[str, Any] = {"soft_was": soft, "soft": soft, "hard": hard}
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            out["soft"] = hard
        except (ValueError, OSError) as e:  # an unlimited hard limit past the kernel's nr_open, say
            out["error"] = str(e)
    return out


def _say_open_files(rank: int, limits: dict[str, Any]) -> None:
    if "error" in limits:
        log.warning("rank %d: the soft limit on open files stays %d: raising it to the hard limit %d failed (%s)",
                    rank, limits["soft"], limits["hard"], limits["error"])
    elif limits["soft"] != limits["soft_was"]:
        log.info("rank %d: soft limit on open files raised from %d to the hard limit %d", rank, limits["soft_was"],
                 limits["soft"])


def _check_open_files(s: Session) -> None:
    """Rank 0 warns when its limit is below what planner/fds.py counts for the layout: the dry run checked the
    layout against job.nofile, an assumption; this is the limit the compute node gave."""
    from hpctrain.planner import fds

    if s.rank != 0 or s.plan is None:
        return
    need = fds.estimate(fds.job_of(s.cfg, s.plan.layout)).total(0)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and need > soft:
        log.warning("rank 0 may need up to %d open files but may open %d: past it the job ends with 'Too many open "
                    "files'; raise the nodes' hard limit (`ulimit -Hn`; `hpctrain submit --dry-run` lists what "
                    "needs them)", need, soft)


def _agree_run_dir(cfg: Config, run_dir: Path | None, rank: int) -> Path:
    """Direct launches get a fresh run directory made by rank 0 and broadcast to all; a failure on rank 0 (a bad
    job.run_root) is broadcast instead, so every rank raises it rather than waiting in the broadcast."""
    if run_dir is not None:
        return run_dir
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = runs.new_run_dir(cfg.job.run_root, cfg.job.name)
            (box[0] / "config.toml").write_text(dump_toml(cfg))
        except (ValueError, OSError) as e:
            box[0] = str(e)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise ValueError(box[0])
    return box[0]


def _keep_earlier_hang(run_dir: Path, rank: int) -> None:
    """A requeued job's rank 0 moves the last hang's files aside before any rank truncates its heartbeat (the
    broadcast is the wait); a failure to move them is said, not fatal."""
    box: list[Any] = [None]
    if rank == 0:
        try:
            kept = keep_earlier_hang(run_dir)
            box[0] = f"the earlier hang's files moved to {kept}" if kept else None
        except OSError as e:
            box[0] = f"the earlier hang's files could not be moved aside: {e}"
    dist.broadcast_object_list(box, src=0)
    if rank == 0 and box[0]:
        log.warning("%s", box[0])


def _hang_channel(world_size: int) -> StoreChannel | None:
    """The watchdog's way to ask the other ranks to dump and hear their answers without a shared file system's
    caches: a client of the job's store of its own (Store.clone(), a second connection to rank 0's server: one
    client serves one thread at a time, and the main thread's may be in a long wait). None for one rank, or when
    there is no store to clone (the watchdog then uses files only). torch keeps the store init_process_group was
    given (rendezvous.init_distributed hands it over, under the job's secret prefix); the hang's keys go under a
    prefix of their own."""
    if world_size == 1:
        return None
    try:
        store = dist.distributed_c10d._get_default_store().clone()
    except (RuntimeError, ValueError, AttributeError) as e:  # no default group, or a store without clone
        log.warning("hang requests go through files only (no store client for the watchdog: %s)", e)
        return None
    return StoreChannel(dist.PrefixStore("hpctrain-hang/", store), world_size)


def cpu_threads(ranks_on_host: int) -> int:
    """Intra-op threads per rank: OMP_NUM_THREADS when set, else the CPUs this process may run on (its affinity
    mask, not the host's count: Slurm, cgroups and containers narrow it), shared with the host's other ranks.

    A mask too wide for every rank of the host to hold one of its size (mask x ranks > host CPUs) is one they all
    share (no per-task binding): divide it. A narrower one was bound to this rank (Slurm's task/affinity,
    mpiexec -bind-to): all of it. Under Slurm never more than SLURM_CPUS_PER_TASK, which also covers a job cpuset
    shared without binding. torch's default of every core per rank oversubscribes the CPU ranks_on_host times."""
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"])
    mask = len(os.sched_getaffinity(0))
    threads = mask // ranks_on_host if mask * ranks_on_host > (os.cpu_count() or mask) else mask
    if os.environ.get("SLURM_CPUS_PER_TASK"):
        threads = min(threads, int(os.environ["SLURM_CPUS_PER_TASK"]))
    return max(1, threads)


def _build_mesh(s: Session) -> None:
    gathered: list[Any] = [None] * s.ident.world_size
    dist.all_gather_object(gathered, (s.ident, Peer.me(s.rank)))
    idents = [i for i, _ in gathered]
    s.hosts = [i.node_name for i in idents]
    if s.watchdog is not None:
        s.watchdog.peers = [p for _, p in gathered]  # a hang on a host without a launcher that ends them all
    threads = cpu_threads(sum(i.host == s.ident.host for i in idents))
    torch.set_num_threads(threads)
    s.summary["cpu_threads_per_rank"] = threads
    node_of_rank = [i.node_index for i in idents]
    s.plan = make_plan(s.cfg, node_of_rank, training=False)  # the trainer adds its part (plan.with_training)
    _check_open_files(s)
    layout = s.plan.layout
    rows = mesh.rank_table(layout, node_of_rank, [i.node_name for i in idents], [i.local_rank for i in idents])
    s.summary["layout"] = {"pp": layout.pp, "dp": layout.dp, "tp": layout.tp} | (
        {"cp": layout.cp, "data": layout.data} if layout.cp > 1 else {}) | (
        {"dp_replicate": layout.replicate, "dp_shard": layout.shard} if layout.replicate > 1 else {})
    s.summary["rank_map"] = rows
    if s.rank == 0:
        for line in mesh.format_rank_map(layout, rows).splitlines():
            log.info("%s", line)
    s.mesh = mesh.build_mesh(layout, node_of_rank, s.device.type)
    if s.heartbeat is not None:
        s.heartbeat.set_facts(coords=s.mesh.coords)
    axes = ("world", *layout.axes)  # cp: its groups are made here, collectively; HSDP's two levels of dp
    checks = mesh.check_groups(s.mesh, s.rank, s.device, axes)
    s.summary["checks"] = checks
    if not checks["ok"]:
        raise RuntimeError("group checks failed:\n" + "\n".join(checks["failures"]))
    log.info("all-reduce checks passed on %s", ", ".join(axes))


def _arm_startup_timer(limit_s: float) -> None:
    """Until the hang watchdog runs: a rank stuck in MPI's start or an MPI exchange of the rendezvous (no timeout of
    their own) prints every thread's stack to the process's stderr and exits 1 after limit_s, which ends the launch
    (faulthandler's own thread fires while the main thread is inside MPI, GIL held or not). Not armed where the
    process has no stderr file to write to (a caller that replaced the streams runs in-process, not as a rank)."""
    stream = sys.__stderr__
    try:
        if stream is not None:
            faulthandler.dump_traceback_later(limit_s, exit=True, file=stream)
    except (OSError, ValueError):  # io.UnsupportedOperation: no fileno
        pass


@contextlib.contextmanager
def start(cfg: Config, run_dir: str | Path | None = None, resumes: bool = False) -> Iterator[Session]:
    """Rendezvous, run directory, logging, mesh and group checks; summary.json and teardown on exit. `resumes`:
    the payload goes on from its last checkpoint when started again (training), so a hang requeues the job
    without its silent nodes (job.node_requeues > 0); other payloads (benchmarks, the doctor) just end.

    A failure under MPI leaves the process group up: the caller ends the launch with ending.abort_launch(),
    and destroy_process_group could wait on a peer that is stopped or stuck in a collective."""
    t0 = time.time()
    flag = process_flag()  # first: a preemption signal from here on is kept, not fatal
    open_files = raise_open_files()  # before MPI, the store and gloo open theirs; said once the log is set up
    p = cfg.parallel
    if p.hang_limits_s is not None:
        _arm_startup_timer(p.hang_limits_s[1])
    try:
        ident = rendezvous.identify(p.rendezvous)
        rdzv_dir = Path(run_dir) if run_dir else Path(cfg.job.run_root).absolute() / ".rendezvous"
        device = rendezvous.init_distributed(ident, p.backend, p.timeout_s, p.master_addr, rdzv_dir,
                                             interface=p.interface, connect_timeout_s=p.connect_timeout_s,
                                             flight_recorder=p.flight_recorder)
    except BaseException:
        faulthandler.cancel_dump_traceback_later()
        raise
    failed = False
    try:
        s = Session(cfg, ident, device, _agree_run_dir(cfg, Path(run_dir) if run_dir else None, ident.rank),
                    preempt=flag)
        runs.setup_logging(s.run_dir, ident.rank)
        _say_open_files(ident.rank, open_files)
        _keep_earlier_hang(s.run_dir, ident.rank)
        s.heartbeat = Heartbeat(s.run_dir, ident.rank, {"host": ident.host, "node": ident.node_name,
                                                        "local_rank": ident.local_rank, "job_id": ident.job_id,
                                                        "launcher": ident.launcher})
        if p.hang_limits_s is not None:
            limits = Limits(*p.hang_limits_s, storage_bps=cfg.checkpoint.storage_gbps * 1e9)
            on_end = (functools.partial(requeue.after_hang, s.run_dir, cfg.job.node_requeues, ident.num_nodes)
                      if resumes and cfg.job.node_requeues else None)
            s.watchdog = Watchdog(s.heartbeat, s.run_dir, limits, channel=_hang_channel(ident.world_size),
                                  on_end=on_end)
        faulthandler.cancel_dump_traceback_later()  # the watchdog speaks from here on
        log.info("rank %d/%d on %s (local rank %d, node %d/%d) via %s, job %s, device %s, startup %.1f s",
                 ident.rank, ident.world_size, ident.node_name, ident.local_rank, ident.node_index,
                 ident.num_nodes, ident.launcher, ident.job_id, device, time.time() - t0)
        s.summary.update({
            "ok": False, "launcher": ident.launcher, "job_id": ident.job_id, "world_size": ident.world_size,
            "num_nodes": ident.num_nodes, "backend": dist.get_backend(), "torch": torch.__version__,
            "python": platform.python_version(), "run_dir": str(s.run_dir), "open_files": open_files,
        })
        try:
            _build_mesh(s)
            yield s
            s.summary["ok"] = True
        except Exception as e:
            s.summary["error"] = f"{type(e).__name__}: {e}"
            log.error("%s", s.summary["error"])
            s.heartbeat.set_facts(failure=s.summary["error"][:300])
            raise
        finally:
            if s.watchdog is not None:
                s.watchdog.stop()
            s.heartbeat.close("done" if s.summary["ok"] else "failed")
            if s.mesh is not None and s.mesh.node_checks:  # node groups the payload asked for, checked then
                s.summary["checks"]["groups"].update(s.mesh.node_checks["groups"])
            s.summary["elapsed_s"] = round(time.time() - t0, 3)
            if ident.rank == 0:
                runs.write_json(s.run_dir / "summary.json", s.summary)
    except BaseException:
        failed = True
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()  # a failure before the watchdog ran
        flag.clear()  # acted on by this session's payload, or by nobody
        if not (failed and ending.mpi_running()):
            dist.destroy_process_group()
