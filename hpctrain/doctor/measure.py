"""What each rank of `hpctrain doctor` measures, inside the job's own session (rendezvous, checked mesh), and the
training job's preflight (job.preflight = true):

    mpiexec -n 4 hpctrain doctor slurm/examples/tiny-cpu.toml --here       # or submitted: hpctrain doctor CONFIG
    report = run(s, Options())          # every rank: measured, gathered, judged alike; rank 0 writes doctor.json
    if not preflight(s): ...            # training: failed under Slurm and requeued without the failed nodes

Per rank: device visibility and GEMM rate. Per communicator instance of tp, intra, dp, inter and world (an axis whose
groups equal an earlier one's is measured once, named by both): all-reduce bus bandwidth at two sizes, checked
results. Per node (local rank 0): write+fsync and cold read rate of the checkpoint directory, free space,
striping, environment. Clock offset of every rank from rank 0's. The verdicts: hpctrain/doctor/report.py.

Ranks that share a host's CPUs (CPU devices) or its disk (two Slurm nodes on one host, as the local cluster runs)
measure in turns, else they would measure each other; on GPUs and across hosts everything runs at once.
Collectives here use tensors on the rank's device (an NCCL group serves only CUDA tensors).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from hpctrain import hostprobe
from hpctrain.bench import gemm, harness
from hpctrain.bench.colls import COLLS, Ctx
from hpctrain.bench.sweep import bandwidths
from hpctrain.doctor import report as doctor_report
from hpctrain.job import preempt, requeue, runs, session
from hpctrain.model.dims import ModelDims
from hpctrain.parallel import mesh
from hpctrain.planner.ckpt_cost import checkpoint_bytes

log = logging.getLogger(__name__)

AXES = ("tp", "intra", "dp", "inter", "world")
PREFLIGHT_AXES = ("tp", "dp", "world")  # training's own groups: no node communicators built just for the check
# (bytes, timed calls) per device: a latency-bound and a bandwidth-bound all-reduce, each timed over ~0.1 s here
# (gloo on loopback) or ~1 ms and more on NVLink/InfiniBand, long enough that one scheduling hiccup does not decide it
SIZES = {"cpu": ((64 << 10, 40), (4 << 20, 10)), "cuda": ((1 << 20, 50), (256 << 20, 10))}


@dataclass
class Options:
    rules: dict[str, float | None] = field(default_factory=dict)  # Rules fields given (None: the device's default)
    axes: tuple[str, ...] = AXES
    storage_mb: int = 128
    reps: int = 3  # best of: noise only ever slows a measurement down; each round goes through every turn
    # storage is best of more: one fsync now and then takes 5x its time here (a healthy node once failed at best
    # of 3 in a full test run), and a round is short (storage_mb each way)
    storage_reps: int = 5

    def __post_init__(self) -> None:
        if not 1 <= self.storage_mb <= hostprobe.MAX_STORAGE_MB:
            raise ValueError(f"storage_mb = {self.storage_mb}: the storage probe writes between 1 and "
                             f"{hostprobe.MAX_STORAGE_MB} MiB per node and round")


class Preempted(Exception):
    """A preemption signal during the preflight of a training job: every rank raises it at the same round."""


def _turns(units: list[set[str]], share: bool) -> list[int]:
    """The turn of each unit (a rank, a group, a node), given the hosts it runs on: with `share`, units that
    share a host go in different turns (first free turn, in order); else all in turn 0."""
    taken: list[set[str]] = []
    out = []
    for hosts in units:
        t = next((i for i, used in enumerate(taken) if not (hosts & used)), len(taken)) if share else 0
        if t == len(taken):
            taken.append(set())
        taken[t] |= hosts
        out.append(t)
    return out


def _in_turns(mine: int | None, turns: int, reps: int, fn: Callable[[], Any],
              stop: Callable[[], bool] | None = None) -> list[Any]:
    """fn()'s results of `reps` rounds, fn run in this rank's turn of each round, a world barrier after every turn;
    [] for a rank with no turn. Rounds go through all turns, so a burst of outside load hits one round of several
    units rather than every round of one. stop(), collective, is asked after every round: True raises Preempted
    on every rank alike. Collective."""
    out = []
    for _ in range(reps):
        for t in range(turns):
            if t == mine:
                out.append(fn())
            dist.barrier()
        if stop is not None and stop():
            raise Preempted
    return out


def device_info(device: torch.device) -> dict[str, Any]:
    cpus, threads = len(os.sched_getaffinity(0)), torch.get_num_threads()
    if device.type != "cuda":
        return {"type": device.type, "index": None, "name": None, "count": 0, "uuid": None, "cpus": cpus,
                "threads": threads}
    props = torch.cuda.get_device_properties(device)
    return {"type": "cuda", "index": device.index, "name": props.name, "count": torch.cuda.device_count(),
            "uuid": str(getattr(props, "uuid", "")), "cpus": cpus, "threads": threads}


def gemm_rate(device: torch.device) -> dict[str, Any]:
    """One GEMM probe (bf16 on GPUs, which the datasheet figure is for; fp32 on CPUs)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = gemm.probe_size(device.type, dtype)
    r = gemm.measure_gemm(dtype, n, device, min_time_s=0.15, warmup=1)
    return {"tflops": r["tflops"], "n": n, "dtype": str(dtype).removeprefix("torch.")}


def axis_groups(m: mesh.Mesh, axis: str) -> list[list[int]]:
    """Every group of an axis, from the rank arithmetic alone."""
    if axis == "world":
        return [list(range(m.layout.world_size))]
    if axis in mesh.AXES:
        return m.layout.groups(axis)
    per_node = mesh.node_members(m.node_of_rank)
    return per_node if axis == "intra" else [list(g) for g in zip(*per_node)]


def _group_op(group, device: torch.device, op) -> Callable[[float], float]:
    def reduce(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op, group=group)
        return t.item()
    return reduce


def allreduce_busbw(members: list[int], rank: int, group, device: torch.device,
                    sizes: tuple[tuple[int, int], ...]) -> dict[str, Any]:
    """The group's all-reduce bus bandwidth (GB/s) per size, from its slowest member's time, and the wrong elements
    the harness's check found. Collective over the group."""
    coll, n = COLLS["all_reduce"], len(members)
    ctx = Ctx(idx=members.index(rank), members=members, group=group, inplace=True)
    gmax, gsum = _group_op(group, device, dist.ReduceOp.MAX), _group_op(group, device, dist.ReduceOp.SUM)
    busbw, wrong = {}, 0
    for size, iters in sizes:
        opts = harness.Options(colls=["all_reduce"], sizes=[size], iters=iters, warmup=2)
        T = size // 4 // coll.align(n) * coll.align(n)
        r = harness.run_placement(coll, ctx, T, opts, device, harness.Inputs(opts, torch.float32, n), gmax,
                                  lambda x: int(gsum(x)), lambda: dist.barrier(group=group))
        busbw[str(size)], wrong = bandwidths(T * 4, r["time_us"] / 1e6, "all_reduce", n)[1], wrong + r["wrong"]
    return {"busbw": busbw, "wrong": wrong}


def clock_offsets(device: torch.device, world: int, rounds: int = 5) -> list[dict[str, float]]:
    """Every rank's wall clock against rank 0's, round trip corrected: rank 0 reads t0 and broadcasts it, each rank
    notes when it arrived, the arrival times are summed to all and rank 0 reads t1. Rank 0's clock read the true
    arrival moment somewhere in [t0, t1]: offset = arrival - (t0 + t1) / 2, within +-(t1 - t0) / 2. The round with
    the shortest trip counts. Collective over the world; the same list on every rank."""
    best: list[dict[str, float]] = []
    for _ in range(rounds):
        dist.barrier()
        t0 = torch.tensor([time.time()], dtype=torch.float64, device=device)
        dist.broadcast(t0, src=0)
        arrived = torch.zeros(world, dtype=torch.float64, device=device)
        arrived[dist.get_rank()] = time.time() - t0.item()  # relative to t0: float64 keeps microseconds
        dist.all_reduce(arrived)
        rtt = torch.tensor([time.time() - t0.item() if dist.get_rank() == 0 else 0.0], dtype=torch.float64,
                           device=device)
        dist.broadcast(rtt, src=0)
        trip, seen = rtt.item(), arrived.tolist()
        if not best or trip * 1e3 < best[0]["rtt_ms"]:
            best = [{"offset_ms": (seen[r] - trip / 2) * 1e3 if r else 0.0, "rtt_ms": trip * 1e3}
                    for r in range(world)]
    return best


def measure(s: session.Session, opts: Options, stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Everything the doctor measures, gathered: the same dict on every rank (doctor_report's input). stop: see
    _in_turns (the preflight passes training's preemption poll)."""
    t_start, rank, dev, cfg = time.time(), s.rank, s.device, s.cfg
    me = {"rank": rank, "node": s.ident.node_name, "host": s.ident.host, "local_rank": s.ident.local_rank}
    idents: list[Any] = [None] * s.ident.world_size
    dist.all_gather_object(idents, me)
    shared = dev.type != "cuda"  # CPU ranks of one host share its cores
    rec: dict[str, Any] = me | {"device": device_info(dev), "groups": [], "storage": None, "env": None}

    turns = _turns([{i["host"]} for i in idents], shared)
    rounds = _in_turns(turns[rank], max(turns) + 1, opts.reps, lambda: gemm_rate(dev), stop)
    rec["gemm"] = max(rounds, key=lambda r: r["tflops"])

    plan: list[tuple[str, list[str], list[list[int]]]] = []  # (axis, its aliases, its groups), alike on every rank
    for axis in opts.axes:
        groups = axis_groups(s.mesh, axis)
        same = next((p for p in plan if p[2] == groups), None)
        if same is not None:
            same[1].append(axis)
        elif len(groups[0]) > 1:
            plan.append((axis, [], groups))
    sizes = SIZES["cuda" if dev.type == "cuda" else "cpu"]
    for axis, aliases, groups in plan:
        group = s.mesh.group(axis)  # collective: the node groups are built on first request
        mine = next(g for g in groups if rank in g)
        turns = _turns([{idents[r]["host"] for r in g} for g in groups], shared)
        rounds = _in_turns(turns[groups.index(mine)], max(turns) + 1, opts.reps,
                           lambda: allreduce_busbw(mine, rank, group, dev, sizes), stop)
        if mine[0] == rank:
            nodes = list(dict.fromkeys(idents[r]["node"] for r in mine))
            rec["groups"].append({"axis": axis, "aliases": aliases, "members": mine, "nodes": nodes,
                                  "busbw": {k: max(r["busbw"][k] for r in rounds) for k in rounds[0]["busbw"]},
                                  "wrong": sum(r["wrong"] for r in rounds)})

    leaders = [i["rank"] for i in idents if i["local_rank"] == 0]
    turns = _turns([{idents[r]["host"]} for r in leaders], True)  # the nodes of one host share its disk
    where = hostprobe.probe_dir(cfg.checkpoint.dir, s.run_dir)
    mine = turns[leaders.index(rank)] if rank in leaders else None
    writers = turns.count(mine)  # nodes of other hosts write in the same turn, maybe to the same file system
    if mine is not None:
        os.sync()  # the node's earlier writes flushed first: an fsync of ours must not time their writeback
    rounds = _in_turns(mine, max(turns) + 1, opts.storage_reps,
                       lambda: hostprobe.storage(where, opts.storage_mb << 20, me["node"], writers), stop)
    if rounds:
        failed = [r for r in rounds if "error" in r]
        rec["storage"] = failed[0] if failed else rounds[0] | {
            k: max(r[k] for r in rounds) for k in ("write_gbps", "read_gbps")}
        if "shrunk" in rec["storage"]:
            log.warning("storage probe of %s on %s: %s", where, me["node"], rec["storage"]["shrunk"])
    rec["env"] = hostprobe.environment() if rank in leaders else None
    offsets = clock_offsets(dev, s.ident.world_size)

    every: list[Any] = [None] * s.ident.world_size
    dist.all_gather_object(every, rec)
    layout = s.mesh.layout
    job = {"job_id": s.ident.job_id, "launcher": s.ident.launcher, "world_size": s.ident.world_size,
           "num_nodes": s.ident.num_nodes, "device": dev.type, "gpu_job": cfg.job.gpus_per_node > 0,
           "profile": cfg.job.gpu or None, "layout": {"pp": layout.pp, "dp": layout.dp, "tp": layout.tp},
           "checkpoint_dir": str(where), "sizes": [size for size, _ in sizes],
           "elapsed_s": round(time.time() - t_start, 2),
           "checkpoint_bytes": checkpoint_bytes(ModelDims.from_config(cfg.model, layout.tp), s.ident.world_size)}
    return {"job": job,
            "ranks": [{k: r[k] for k in ("rank", "node", "host", "local_rank", "device", "gemm")} for r in every],
            "groups": sorted((g for r in every for g in r["groups"]),
                             key=lambda g: (opts.axes.index(g["axis"]), g["members"])),
            "nodes": [{"node": r["node"], "host": r["host"], "storage": r["storage"], "env": r["env"],
                       "clock": offsets[r["rank"]]} for r in every if r["rank"] in leaders]}


def run(s: session.Session, opts: Options, stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Measures and judges (every rank alike); rank 0 writes doctor.json into the run directory."""
    rules = doctor_report.Rules.for_device(s.device.type, **opts.rules)
    expected = doctor_report.expected_figures(s.cfg.job.gpu, s.cfg.job.hw_profile) if s.cfg.job.gpu else None
    report = doctor_report.analyse(measure(s, opts, stop), rules, expected)
    s.summary["doctor"] = {k: report[k] for k in ("ok", "failed_nodes", "unattributed", "exclude")}
    if s.rank == 0:
        runs.write_json(s.run_dir / "doctor.json", report)
        log.info("doctor: %s in %.1f s; doctor.json in %s", "passed" if report["ok"] else
                 f"FAILED ({', '.join(report['failed_nodes'] + report['unattributed'])})",
                 report["job"]["elapsed_s"], s.run_dir)
    return report


def preflight(s: session.Session) -> bool:
    """job.preflight: the doctor's checks on training's own groups, after the mesh and before the model. True:
    passed. False: this attempt ends without training: failed under Slurm, and the job was requeued without the
    failed nodes (Slurm starts it again elsewhere); or preempted (training's flag, polled after every round of
    measurements), and requeued as training is before its first step. Otherwise a failure raises with the
    table."""
    try:
        margin = s.cfg.job.preflight_margin or None
        rules = {"margin": margin, "storage_margin": margin}
        report = run(s, Options(rules=rules, axes=PREFLIGHT_AXES), stop=lambda: s.preempt.poll(s.device))
    except Preempted:
        said = preempt.requeue() if s.rank == 0 else None
        s.summary["preflight"] = {"preempted": True, "requeue": said}
        if s.rank == 0:
            log.warning("preempted during the preflight: this attempt ends without training; %s", said)
        return False
    table = doctor_report.render(report)
    if s.rank == 0:
        for line in table.splitlines():
            log.info("preflight | %s", line)
    if report["ok"]:
        return True
    box: list[Any] = [None]
    if s.rank == 0:
        requeued, why = requeue.requeue_without(report["failed_nodes"], s.run_dir, s.cfg.job.node_requeues,
                                                     s.ident.num_nodes)
        box[0] = {"cause": "preflight", "requeued": requeued, "why": why, "failed_nodes": report["failed_nodes"],
                  "unattributed": report["unattributed"], "restart": os.environ.get("SLURM_RESTART_COUNT", "0"),
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        try:
            requeue.record(s.run_dir, box[0])
        except OSError as e:  # said, not fatal: the other ranks wait for this one's verdict
            log.warning("preflight: %s", e)
    dist.broadcast_object_list(box, src=0)
    s.summary["preflight"] = box[0]
    if box[0]["requeued"]:
        log.warning("preflight failed on %s: %s; this attempt ends without training",
                    ", ".join(report["failed_nodes"]), box[0]["why"])
        return False
    raise RuntimeError(f"preflight failed: {box[0]['why']}\n{table}")
