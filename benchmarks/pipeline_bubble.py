"""Pipeline bubble and activation memory of hpctrain's schedules, p = 2 stages ranks, against the theory.

    python benchmarks/pipeline_bubble.py [--steps 10] [--ms 2,4,8]   # driver: launches itself under mpiexec -n 2
    mpiexec -n 2 python benchmarks/pipeline_bubble.py --worker        # the same, one launch

One session; for each schedule (GPipe, 1F1B, interleaved 1F1B with v = 2 virtual stages per rank) and each
micro-batch count m = p, 2p, 4p a Trainer is built on the same pp=2 mesh and trains: 2 warm-up steps (the first
infers shapes), then --steps timed steps. Each rank measures, per step, the wall time of the schedule and the time
its own stages spend computing (TimedStage: forward, backward, weight gradients); idle = 1 - compute / wall is the
bubble plus point-to-point communication. A step's idle fraction is the mean over the ranks.

Rule (benchmarks/README.md, _verdict.py): every timed step counts (a step is a round); per (schedule, m) row the
verdict is on the median over steps of (measured idle fraction - theory (p - 1) / (v m + p - 1)), with its 95%
interval, target within 0 +- 0.05 (5 points); one verdict per row. There is no second side to alternate with: the
rows run one after another in a fixed order.

Memory: one more step per case runs under torch.autograd.graph.saved_tensors_hooks, which records every tensor
autograd keeps for backward (by storage, parameters left out) and when it is released; the peak of what is alive
at once is the activation memory the schedule needs. The claim: under 1F1B stage s keeps at most p - s
micro-batches in flight where GPipe keeps all m, so peak(1F1B) / peak(GPipe) on rank s is (p - s) / m (p / m on
the first stage). Per (m, rank) a verdict on that ratio divided by (p - s) / m, target <= 1.01 (1% for the few
tensors that are not per micro-batch); the counts are deterministic, so each is one round.
The model: 8 blocks of dim 512 (2 per stage with interleaving, 4 without), 2 x 128 tokens per micro-batch, fp32,
one thread per rank on this 2-core machine. Writes benchmarks/results/pipeline_bubble.json.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

from _verdict import verdict

from _launch import mpiexec, write_results

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TARGET = 0.05  # idle fraction, measured - theory, per step
MEMORY_TARGET = 1.01  # peak 1F1B / GPipe over its theory (p - s) / m
P = 2
CASE = ["model.vocab_size=256", "model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.max_seq_len=128",
        "data.source=synthetic", "data.seq_len=128", "train.micro_batch_size=2", "train.peak_tflops=1",
        "train.log_every=1000", "parallel.pp=2", "parallel.tp=1", "parallel.dp=-1", "job.name=bench-pipeline",
        "job.run_root=/tmp/hpctrain-bench-runs"]
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]


class SavedMeter:
    """Live bytes of tensors saved for backward (distinct storages, parameters excluded) and their peak."""

    def __init__(self, skip: set[int]) -> None:
        self.skip, self.live, self.now, self.peak = skip, {}, 0, 0

    def pack(self, t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self.skip or st.nbytes() == 0:
            return t
        holder = _Held(t)
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [1, st.nbytes()]
            self.now += st.nbytes()
            self.peak = max(self.peak, self.now)
        else:
            entry[0] += 1
        weakref.finalize(holder, self._release, ptr)  # autograd drops the holder when it frees the graph
        return holder

    @staticmethod
    def unpack(x):
        return x.t if isinstance(x, _Held) else x

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[ptr]


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t) -> None:
        self.t = t


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from hpctrain.config import load_config
    from hpctrain.job import session
    from hpctrain.train.trainer import Trainer

    ms = [int(m) for m in args.ms.split(",")]
    t_start = time.perf_counter()
    with session.start(load_config(None, CASE)) as s:
        rank = dist.get_rank()
        rows = []
        for sched, v in SCHEDULES:
            for m in ms:
                cfg = load_config(None, CASE + [f"parallel.pp_schedule={sched}", f"parallel.pp_virtual_stages={v}",
                                                f"train.grad_accum={m}"])
                tr = Trainer(cfg, s)
                for _ in range(2):
                    tr.train_step()
                tr.pipe.timing()
                idle, wall = [], []
                for _ in range(args.steps):
                    tr.train_step()
                    t = tr.pipe.timing()
                    idle.append(1 - t["busy_s"] / t["wall_s"])
                    wall.append(t["wall_s"])
                params = {p.untyped_storage().data_ptr() for p in tr.model.parameters()}
                meter = SavedMeter(params)
                with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                    tr.train_step()
                mine = {"idle": idle, "step_s": wall, "peak": meter.peak}
                every: list = [None] * dist.get_world_size()
                dist.all_gather_object(every, mine)
                theory = tr.pm.plan.bubble_theory(m)
                step_means = [statistics.fmean(e["idle"][k] for e in every) for k in range(args.steps)]
                rows.append({"schedule": sched, "virtual": v, "m": m, "theory": theory,
                             "idle_per_rank": [statistics.median(e["idle"]) for e in every],
                             "idle_median": statistics.median(step_means),
                             "idle_minus_theory": [x - theory for x in step_means],
                             "idle_per_step": step_means, "idle_per_rank_per_step": [e["idle"] for e in every],
                             "step_s": statistics.median(every[0]["step_s"]),
                             "peak_saved_bytes": [e["peak"] for e in every]})
                del tr
        if rank == 0:
            report(rows, ms, args, time.perf_counter() - t_start)


def report(rows: list[dict], ms: list[int], args, elapsed: float) -> None:
    print(f"# pipeline bubble, p={P} ranks, gloo on CPU: idle = 1 - compute / schedule wall time, per step the mean "
          f"over ranks; {args.steps} steps per row, every step counts")
    print(f"# {'schedule':<17} {'v':>2} {'m':>3} {'theory':>7} {'idle r0':>8} {'idle r1':>8} {'median':>7} "
          f"{'step ms':>8} {'saved MB r0':>12} {'saved MB r1':>12}")
    for r in rows:
        print(f"  {r['schedule']:<17} {r['virtual']:>2} {r['m']:>3} {r['theory']:>7.3f} {r['idle_per_rank'][0]:>8.3f} "
              f"{r['idle_per_rank'][1]:>8.3f} {r['idle_median']:>7.3f} {1e3 * r['step_s']:>8.1f} "
              f"{r['peak_saved_bytes'][0] / 1e6:>12.1f} {r['peak_saved_bytes'][1] / 1e6:>12.1f}")
    recs = []
    for r in rows:
        name = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B v=2"}[r["schedule"]]
        recs.append(verdict("pipeline_bubble", f"idle fraction - theory, {name}, p={P}, m={r['m']}",
                            r["idle_minus_theory"], TARGET, better="within", center=0.0, unit="",
                            note=f"theory (p-1)/(vm+p-1) = {r['theory']:.3f}, per step"))
    by = {(r["schedule"], r["m"]): r for r in rows}
    memory = []
    for m in ms:
        g, o = by.get(("gpipe", m)), by.get(("1f1b", m))
        if not (g and o):
            continue
        ratio = [a / b for a, b in zip(o["peak_saved_bytes"], g["peak_saved_bytes"])]
        theory = [(P - st) / m for st in range(P)]
        memory.append({"m": m, "ratio_1f1b_vs_gpipe": ratio, "theory": theory})
        for st in range(P):
            recs.append(verdict("pipeline_bubble", f"peak saved activations 1F1B / GPipe / theory, rank {st}, m={m}",
                                [ratio[st] / theory[st]], MEMORY_TARGET, better="lower",
                                note=f"theory (p-s)/m = {theory[st]:.3f}; counted bytes, 1 step"))
    print(f"# {elapsed:.0f} s")
    write_results("pipeline_bubble.json", {"pp": P, "verdicts": recs, "steps": args.steps, "rows": rows,
                                           "memory": memory, "target": TARGET, "memory_target": MEMORY_TARGET,
                                           "seconds": elapsed, "when": time.strftime("%Y-%m-%dT%H:%M:%S")})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true", help="run as one rank (under mpiexec -n 2)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (rounds) per row")
    ap.add_argument("--ms", default="2,4,8", help="micro-batch counts (p, 2p, 4p)")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    cmd = [mpiexec(), "-n", "2", sys.executable, str(Path(__file__).resolve()), "--worker", "--steps",
           str(args.steps), "--ms", args.ms]
    print(f"=== {' '.join(cmd)}", flush=True)
    sys.exit(subprocess.call(cmd, cwd=HERE.parent))


if __name__ == "__main__":
    main()
