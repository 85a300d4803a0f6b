"""hpctrain bench's harness against an independent baseline, per collective, size and world, on two backends, both
sides timing a call by the same definition.

    mpiexec -n 4 python benchmarks/collectives_vs_bare.py [--sizes 1M,4M,16M] [--rounds 16] [--backends torch,mpi]
        [--average 1] [--blocking 0] [--results DIR]

The definition is nccl-tests' (src/common.cu): after warm-up and a barrier, the host clock over n calls, per call,
issued as -z says (0: launched back to back, one wait at the end; 1: each waited for, then a barrier), and the
ranks' times combined as -a says (0 rank 0's, 1 the mean, 2 the minimum, 3 the maximum); algbw = bytes / time,
busbw = algbw x nccl-tests' factor (all_reduce 2(n-1)/n, all_gather, reduce_scatter and alltoall (n-1)/n,
broadcast 1). Ours is harness.run_placement as `hpctrain bench -a A -z Z` runs it (its own buffers, warm-up,
barrier, timed loop), with benchjob's control functions for the backend under test. The baselines, written here
without hpctrain.bench code, implement the same -a and -z:
  torch  n torch.distributed launches (async_op=True) waited for at the end (-z 0) or one by one with a barrier
         after each (-z 1); the ranks' times combined by an all-reduce (sum / ranks, min, max) or rank 0's
         broadcast.
  mpi    a raw mpi4py loop of blocking calls (comm.Allreduce, Allgather, Reduce_scatter_block, Alltoall, Bcast) on
         numpy buffers: calls back to back (-z 0) or each followed by a barrier (-z 1), combined the same way
         through MPI.
Before issue 26 ours took the slowest rank's time with each call waited for, against this baseline's mean of
back-to-back launches: two definitions, so its verdicts (results files of format 2) do not carry over.

Rule (benchmarks/README.md, _verdict.py): per (backend, collective, size >= 1 MiB, world) R rounds; in each round
both sides run the same number of iterations on buffers allocated once, which goes first alternating
(_verdict.balanced); a round's ratio is baseline time / our time = our busbw / baseline busbw; the verdict is
the median of the per-round ratios with its 95% interval, target >= 0.97, one verdict per size, none pooled.

Rank 0 writes <results>/collectives-<n>ranks.json (the raw rounds of this world) and rebuilds
<results>/collectives.json, which holds the verdicts of every world whose per-world file is present (run_all runs
2 then 4 ranks): the verdicts live only there. --results defaults to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from _verdict import balanced, verdict

from hpctrain.bench import colls, harness, sweep
from hpctrain.bench import job as benchjob
from hpctrain.config import load_config
from hpctrain.job import session

RESULTS = Path(__file__).resolve().parent / "results"
BENCH = "collectives_vs_bare"
TARGET = 0.97
FORMAT = 3  # per-world files of this layout (raw rounds per backend, -a and -z); older ones are not aggregated
# the placement compared (torch has no out-of-place all_reduce or broadcast), as the harness names it
CASES = {"all_reduce": "in", "all_gather": "out", "reduce_scatter": "out", "alltoall": "out", "broadcast": "in"}
# nccl-tests' bus bandwidth factors (PERFORMANCE.md), written out here on purpose: not hpctrain's table
BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
       "reduce_scatter": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# -a and -z in words, for the notes (nccl-tests' numbering)
AVERAGE_WORDS = {0: "rank 0's time", 1: "rank mean", 2: "rank min", 3: "rank max"}
BLOCKING_WORDS = {0: "launched back to back, one wait", 1: "each waited for, then a barrier"}


def elements(name: str, size: int, n: int) -> int:
    """Total float32 elements of the message (nccl-tests' size: all_gather's output, reduce_scatter's input),
    a multiple of n where the collective splits it."""
    t = size // 4
    return t // n * n if name in ("all_gather", "reduce_scatter", "alltoall") else t


class TorchBaseline:
    """nccl-tests' timing on torch.distributed: n launches, waited for at the end (-z 0) or one by one with a
    barrier after each (-z 1), time / n, combined over the ranks as -a says."""

    def __init__(self, name: str, T: int, n: int, device: torch.device) -> None:
        self.name, self.device = name, device
        full = torch.ones(T, dtype=torch.float32, device=device)
        part = torch.ones(T // n, dtype=torch.float32, device=device)
        self.send, self.recv = {"all_reduce": (full, full), "all_gather": (part, full),
                                "reduce_scatter": (full, part), "alltoall": (full, torch.ones_like(full)),
                                "broadcast": (full, full)}[name]

    def launch(self):
        s, r = self.send, self.recv
        if self.name == "all_reduce":
            return dist.all_reduce(r, async_op=True)
        if self.name == "all_gather":
            return _GATHER(r, s, async_op=True)
        if self.name == "reduce_scatter":
            return _SCATTER(r, s, async_op=True)
        if self.name == "alltoall":
            return dist.all_to_all_single(r, s, async_op=True)
        return dist.broadcast(r, src=0, async_op=True)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, iters: int, warmup: int, average: int = 1, blocking: int = 0) -> float:
        self.send.fill_(1.0)
        self.recv.fill_(1.0)
        for w in [self.launch() for _ in range(warmup)]:
            w.wait()
        self._sync()
        dist.barrier()
        t0 = time.perf_counter()
        if blocking:
            for _ in range(iters):
                self.launch().wait()
                self._sync()
                dist.barrier()
        else:
            for w in [self.launch() for _ in range(iters)]:
                w.wait()
            self._sync()
        t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=self.device)
        if average == 0:
            dist.broadcast(t, src=0)
        else:
            dist.all_reduce(t, op={1: dist.ReduceOp.SUM, 2: dist.ReduceOp.MIN, 3: dist.ReduceOp.MAX}[average])
        return t.item() / (dist.get_world_size() if average == 1 else 1)


class MpiBaseline:
    """A raw mpi4py loop on numpy buffers: barrier, n blocking calls back to back (-z 0) or each followed by a
    barrier (-z 1), time / n, combined over the ranks as -a says."""

    def __init__(self, name: str, T: int, n: int) -> None:
        from mpi4py import MPI
        self.MPI, self.comm, self.name = MPI, MPI.COMM_WORLD, name
        self.send = np.ones(T // n if name == "all_gather" else T, dtype=np.float32)
        self.recv = np.ones(T // n if name == "reduce_scatter" else T, dtype=np.float32)

    def call(self) -> None:
        c, s, r = self.comm, self.send, self.recv
        if self.name == "all_reduce":
            c.Allreduce(self.MPI.IN_PLACE, r, op=self.MPI.SUM)
        elif self.name == "all_gather":
            c.Allgather(s, r)
        elif self.name == "reduce_scatter":
            c.Reduce_scatter_block(s, r, op=self.MPI.SUM)
        elif self.name == "alltoall":
            c.Alltoall(s, r)
        else:
            c.Bcast(r, root=0)

    def time(self, iters: int, warmup: int, average: int = 1, blocking: int = 0) -> float:
        self.send.fill(1.0)
        self.recv.fill(1.0)
        for _ in range(warmup):
            self.call()
        self.comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            self.call()
            if blocking:
                self.comm.Barrier()
        mine = (time.perf_counter() - t0) / iters
        if average == 0:
            return self.comm.bcast(mine, root=0)
        op = {1: self.MPI.SUM, 2: self.MPI.MIN, 3: self.MPI.MAX}[average]
        return self.comm.allreduce(mine, op=op) / (self.comm.Get_size() if average == 1 else 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1M,4M,16M", help="message sizes; each >= 1 MiB gets its own verdict")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--backends", default="torch,mpi")
    ap.add_argument("--loop-s", type=float, default=0.1, help="target seconds per timed loop")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--run-root", default="/tmp/hpctrain-bench-runs")
    ap.add_argument("--average", "-a", type=int, default=1, choices=range(4),
                    help="both sides: 0 rank 0's time, 1 the mean over ranks, 2 min, 3 max (nccl-tests' -a)")
    ap.add_argument("--blocking", "-z", type=int, default=0, choices=range(2),
                    help="both sides: 0 calls back to back, one wait; 1 wait and barrier after each (nccl-tests' -z)")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the results files go")
    args = ap.parse_args()
    sizes = [sweep.parse_size(s) for s in args.sizes.split(",")]
    cfg = load_config(None, ["job.name=bench-vs-bare", f"job.run_root={args.run_root}"])
    t_start = time.perf_counter()
    with session.start(cfg) as s:
        n, rank = dist.get_world_size(), dist.get_rank()
        rows = []
        for backend in args.backends.split(","):
            base_opts = harness.Options(colls=list(CASES), sizes=sizes, warmup=args.warmup, check=False,
                                        backend=backend, average=args.average, blocking=args.blocking)
            ctx = benchjob.make_ctx(s, base_opts)
            world_time, world_sum, barrier = benchjob.world_control(base_opts, s.device)
            for name, placement in CASES.items():
                coll = colls.COLLS[name]
                pctx = replace(ctx, inplace=placement == "in")
                for size in sizes:
                    T = elements(name, size, n)
                    base = TorchBaseline(name, T, n, s.device) if backend == "torch" else MpiBaseline(name, T, n)
                    opts = replace(base_opts, colls=[name], placements=(placement,))
                    bufs = harness.alloc_buffers(coll, pctx, T, torch.float32, s.device, backend)
                    inputs = harness.Inputs(opts, torch.float32, n)
                    # iterations for a ~loop_s timed loop, from the baseline's probe (the same on every rank)
                    probe = _world_max(base.time(3, 1), s.device)
                    iters = max(5, min(200, int(args.loop_s / max(probe, 1e-6))))
                    one = replace(opts, iters=iters)
                    times: dict[str, list[float]] = {"ours": [], "baseline": []}
                    for i in range(args.rounds):
                        for side in balanced(i, ("ours", "baseline")):
                            if side == "baseline":
                                times[side].append(base.time(iters, args.warmup, args.average, args.blocking))
                            else:
                                res = harness.run_placement(coll, pctx, T, one, s.device, inputs, world_time,
                                                            world_sum, barrier, buffers=bufs)
                                times[side].append(res["time_us"] / 1e6)
                    ratios = [b / o for b, o in zip(times["baseline"], times["ours"])]
                    rows.append({"backend": backend, "coll": name, "placement": placement, "size": T * 4,
                                 "nranks": n, "iters": iters, "warmup": args.warmup, "average": args.average,
                                 "blocking": args.blocking, "ratios": ratios,
                                 "ours_time_s": times["ours"], "baseline_time_s": times["baseline"]})
        if rank == 0:
            report(rows, n, args, time.perf_counter() - t_start)


def _world_max(x: float, device: torch.device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def busbw(name: str, size: int, t: float, n: int) -> float:
    return size / t / 1e9 * BUS[name](n)


def size_text(b: int) -> str:
    return f"{b / 2**20:g} MiB" if b >= 2**20 else f"{b / 2**10:g} KiB"


def records(rows: list[dict]) -> list[dict]:
    """One verdict per (backend, collective, size >= 1 MiB) of a world; sizes below 1 MiB are only tabled."""
    out = []
    for r in rows:
        if r["size"] < 1 << 20:
            continue
        n = r["nranks"]
        both = (f"both -a {r['average']} -z {r['blocking']}: {AVERAGE_WORDS[r['average']]}, "
                f"{BLOCKING_WORDS[r['blocking']]}")
        if r["backend"] == "torch":
            metric = f"busbw harness / nccl-tests loop, {r['coll']} {size_text(r['size'])}, {n} ranks, gloo"
            note = f"baseline: torch.distributed async launches; {both}"
        else:
            metric = f"busbw harness / raw mpi4py, {r['coll']} {size_text(r['size'])}, {n} ranks, mpich"
            note = f"baseline: blocking mpi4py on numpy; {both}"
        rec = verdict(BENCH, metric, r["ratios"], TARGET, note=note)
        rec.update(backend=r["backend"], coll=r["coll"], size=r["size"], nranks=n)
        out.append(rec)
    return out


def report(rows: list[dict], n: int, args, elapsed: float) -> None:
    print(f"# hpctrain bench harness vs independent baselines, {n} ranks, float32, {args.rounds} rounds, order "
          f"alternating; ratio = baseline time / our time = our busbw / baseline busbw; both sides -a "
          f"{args.average} ({AVERAGE_WORDS[args.average]}) -z {args.blocking} ({BLOCKING_WORDS[args.blocking]})")
    print(f"# {'backend':<7} {'collective':<15} {'size':>8} {'iters':>5} {'ours busbw':>10} {'base busbw':>10} "
          f"(GB/s, medians over rounds)")
    for r in rows:
        med = lambda xs: float(np.median(xs))  # noqa: E731
        print(f"  {r['backend']:<7} {r['coll']:<15} {size_text(r['size']):>8} {r['iters']:>5} "
              f"{busbw(r['coll'], r['size'], med(r['ours_time_s']), n):>10.3f} "
              f"{busbw(r['coll'], r['size'], med(r['baseline_time_s']), n):>10.3f}")
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / f"collectives-{n}ranks.json"
    out.write_text(json.dumps({"format": FORMAT, "nranks": n, "rounds": args.rounds, "target": TARGET,
                               "seconds": elapsed, "torch": torch.__version__,
                               "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows}, indent=1) + "\n")
    print(f"# wrote {out} ({elapsed:.0f} s)", flush=True)
    aggregate(n, args.results)


def aggregate(printed_world: int, results: Path = RESULTS) -> None:
    """<results>/collectives.json: the verdicts of every world's per-world file of this format (only this run's
    world prints its VERDICT lines here; the others printed theirs when they ran)."""
    recs, worlds = [], []
    for path in sorted(results.glob("collectives-*ranks.json"), key=lambda p: int(p.stem.split("-")[1][:-5])):
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT:
            print(f"# {path.name}: an older layout, left out of collectives.json (run that world again)")
            continue
        worlds.append(doc["nranks"])
        if doc["nranks"] == printed_world:
            recs += records(doc["rows"])
        else:
            with contextlib.redirect_stdout(io.StringIO()):
                recs += records(doc["rows"])
    missed = [r["metric"] for r in recs if not r["met"]]
    out = results / "collectives.json"
    out.write_text(json.dumps({"benchmark": BENCH, "worlds": worlds, "target": TARGET, "verdicts": recs,
                               "not_met": missed, "when": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1) + "\n")
    print(f"# wrote {out}: worlds {worlds}, {len(recs)} verdicts, {len(missed)} NOT MET", flush=True)


if __name__ == "__main__":
    main()
