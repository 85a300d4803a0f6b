"""What each rank runs for `hpctrain bench`: the same session as training (rendezvous, checked mesh), then the
collective sweep on the requested communicator, or the GEMM probe.

    mpiexec -n 4 hpctrain bench all -b 1K -e 16M -c 1 --config slurm/examples/tiny-cpu.toml
    hpctrain bench all_reduce --group inter --submit --wait --config my.toml

Rank 0 prints the nccl-tests table and writes bench.txt, bench.jsonl and busbw.png into the run directory; any
wrong element makes every rank exit non-zero.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hpctrain import dtypes
from hpctrain.bench import gemm, harness, plot, sweep
from hpctrain.bench.colls import Ctx, all_gather_single
from hpctrain.config import Config
from hpctrain.job import session

log = logging.getLogger(__name__)


def world_control(opts: harness.Options, device: torch.device):
    """(world_time, world_sum, barrier) over the backend under test, for run_placement: world_time(seconds)
    gathers every rank's time and returns them combined by opts.average (sweep.combine_times: rank 0's, the mean,
    min or max, as nccl-tests' -a), world_sum(int) is an all-reduce over the world, both returning the result on
    each rank, barrier() waits for all ranks. Under opts.backend == "mpi" they go through mpi4py's COMM_WORLD (MPI
    timings never touch torch); otherwise through torch.distributed's default group, with tensors on `device`.
    Collective: every rank calls."""
    if opts.backend == "mpi":
        from mpi4py import MPI
        w = MPI.COMM_WORLD
        return ((lambda x: sweep.combine_times(w.allgather(x), opts.average)),
                (lambda x: w.allreduce(x, op=MPI.SUM)), w.Barrier)

    def gather(x: float) -> list[float]:
        mine = torch.tensor([x], dtype=torch.float64, device=device)
        every = torch.empty(dist.get_world_size(), dtype=torch.float64, device=device)
        all_gather_single(every, mine)
        return every.tolist()

    def total(x: int) -> int:
        t = torch.tensor([x], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return int(t.item())

    return (lambda x: sweep.combine_times(gather(x), opts.average)), total, dist.barrier


def make_ctx(s: session.Session, opts: harness.Options) -> Ctx:
    members = s.mesh.members(opts.group, s.rank)
    ctx = Ctx(idx=members.index(s.rank), members=members, op=opts.op, root=opts.root,
              group=s.mesh.group(opts.group))
    if opts.backend == "mpi":
        if s.ident.launcher != "mpi":
            raise ValueError(f"--backend mpi needs an MPI launch (mpiexec, or srun --mpi=pmi2); this job was "
                             f"started by {s.ident.launcher}")
        from mpi4py import MPI
        ctx.comm = MPI.COMM_WORLD.Split(color=min(members), key=s.rank)
    if opts.algo == "hier":
        ctx.hier = (s.mesh.group("intra"), s.mesh.group("inter"))
    return ctx


class Printer:
    """Rank 0's output: stdout and bench.txt in the run directory."""

    def __init__(self, s: session.Session) -> None:
        self.on = s.rank == 0
        self.path = s.run_dir / "bench.txt"

    def __call__(self, line: str) -> None:
        if self.on:
            print(line, flush=True)
            with self.path.open("a") as f:
                f.write(line + "\n")


def _preamble(s: session.Session, opts: harness.Options, ctx: Ctx, out: Callable[[str], None]) -> None:
    info = {"rank": s.rank, "pid": os.getpid(), "node": s.ident.node_name, "device": str(s.device)}
    every: list[Any] = [None] * s.ident.world_size
    dist.all_gather_object(every, info)
    backend = f"mpi4py ({s.ident.launcher} launch)" if opts.backend == "mpi" else f"torch {dist.get_backend()}"
    out(f"# hpctrain bench: {', '.join(opts.colls)} | group {opts.group} ({ctx.n} ranks each) | backend {backend}"
        f" | algo {opts.algo} | -d {opts.dtype} -o {opts.op} -r {opts.root} -n {opts.iters} -w {opts.warmup}"
        f" -c {int(opts.check)} -a {opts.average} -z {opts.blocking}")
    for i in every:
        out(f"#  Rank {i['rank']:3d} Pid {i['pid']:7d} on {i['node']:>10} device {i['device']}")


def beat(s: session.Session, what: str) -> None:
    """Each finished size is progress for the hang watchdog (a sweep as a whole may outlast its start-up limit)."""
    if s.heartbeat is not None:
        s.heartbeat.enter("startup", f"bench {what}")


def run_collectives(s: session.Session, opts: harness.Options, json_path: str | None,
                    plot_path: str | None) -> dict[str, Any]:
    ctx = make_ctx(s, opts)
    world_time, world_sum, barrier = world_control(opts, s.device)
    out = Printer(s)
    _preamble(s, opts, ctx, out)
    rows: list[sweep.Row] = []
    for name in opts.colls:
        out("#")
        for line in sweep.table_header(f"{name}{' (hierarchical)' if opts.algo == 'hier' else ''}", opts.average,
                                       opts.blocking):
            out(line)
        one = replace(opts, colls=[name])
        rows += harness.run_benchmark(one, ctx, s.device, world_time, world_sum, barrier,
                                      emit=lambda row: (out(sweep.format_row(row)), beat(s, name)))
    for line in sweep.summary_lines(rows):
        out(line)
    wrong = sum(res["wrong"] or 0 for r in rows for res in (r.out, r.inp) if res is not None)
    data = [r.to_json() for r in rows]
    if s.rank == 0:
        targets = [s.run_dir / "bench.jsonl"] + ([Path(json_path)] if json_path else [])
        for path in targets:
            path.write_text("".join(json.dumps(d) + "\n" for d in data))
        title = f"{dist.get_world_size()} ranks, group {opts.group}, {opts.backend}, {opts.dtype}"
        for path in [s.run_dir / "busbw.png"] + ([Path(plot_path)] if plot_path else []):
            plot.plot_busbw(data, path, title)
    s.summary["bench"] = {"rows": len(rows), "wrong": wrong, "colls": opts.colls, "group": opts.group}
    if wrong:
        raise RuntimeError(f"{wrong} wrong element(s) in the benchmark results")
    return s.summary


def run_gemm(s: session.Session, names: list[str], n: int) -> dict[str, Any]:
    out = Printer(s)
    out(f"# GEMM probe: {n} x {n} matmul on {s.device}, per rank; the job's slowest rank is reported")
    out(f"# {'dtype':>9} {'iters':>6} {'time (s)':>9} {'TFLOP/s':>9}")
    results = {}
    for name in names:
        dtype = dtypes.torch_dtype(name)
        r = gemm.measure_gemm(dtype, n, s.device)
        t = torch.tensor([r["tflops"]], dtype=torch.float64, device=s.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        r["tflops"] = t.item()
        results[name] = r
        out(f"  {name:>9} {r['iters']:>6} {r['time_s']:>9.3f} {r['tflops']:>9.4f}")
    if s.rank == 0:
        (s.run_dir / "gemm.json").write_text(json.dumps(results, indent=2) + "\n")
    s.summary["gemm"] = results
    return s.summary


def main(cfg: Config, run_dir: str | None, action: Callable[[session.Session], dict[str, Any]]) -> dict[str, Any]:
    with session.start(cfg, run_dir) as s:
        action(s)
    return s.summary
