"""`make bench`: the full hpctrain bench table on 4 local ranks, then the side-by-side benchmarks: collectives vs
bare torch.distributed, Trainer overhead vs a plain loop, ZeRO memory vs its equation, activation checkpointing,
checkpoint save/load throughput (HDF5 vs DCP vs torch.save vs dd), async checkpoint stall, pipeline bubble and
activation memory per schedule and per block, context parallel's memory and step time, one 70B rank's
initialisation, the planner's step time.

    python benchmarks/run_all.py [--only table,collectives,overhead,memory,ac,activations,cp,ckpt_io,ckpt_async,
                                        pipeline,prefetch,init,plan_time]
                                 [--ranks 4]

Each step is a separate launch, under mpiexec (the venv's, from the mpich wheel, or the site's) where it needs
several ranks; outputs go to benchmarks/results/. Every benchmark judges itself by the rule in
benchmarks/README.md; afterwards readme_table.py rewrites that file's "Measured here" table from the results
files' verdict records (a missed target is a NOT MET row, not a failed step). Exits non-zero if a step fails (a
wrong collective result, or a benchmark whose two sides disagree, included).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import _launch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
EXAMPLE = REPO / "slurm" / "examples" / "tiny-cpu.toml"


def mpiexec(n: int, *cmd: str) -> list[str]:
    return [_launch.mpiexec(), "-n", str(n), *cmd]


def hpctrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpctrain.cli", *args]


def steps(ranks: int) -> dict[str, list[list[str]]]:
    run_root = "/tmp/hpctrain-bench-runs"
    return {
        "table": [mpiexec(ranks, *hpctrain(
            "bench", "all", "-b", "1K", "-e", "16M", "-f", "4", "-n", "10", "-w", "2", "-c", "1",
            "--config", str(EXAMPLE), "--set", f"job.run_root={run_root}",
            "-J", str(RESULTS / f"bench-{ranks}ranks.jsonl"), "--plot", str(RESULTS / f"busbw-{ranks}ranks.png")))],
        "collectives": [mpiexec(n, sys.executable, str(HERE / "collectives_vs_bare.py")) for n in (2, 4)],
        "overhead": [[sys.executable, str(HERE / "train_overhead.py"), "--run-root", run_root]],
        # a driver: launches itself under mpiexec -n 2 and -n 4
        "memory": [[sys.executable, str(HERE / "zero_memory.py"), "--run-root", run_root]],
        "ac": [[sys.executable, str(HERE / "activation_checkpointing.py"), "--run-root", run_root]],
        # a driver: 1, 2 and 4 ranks (tensor parallel 1, 2, 4); bytes counted
        "activations": [[sys.executable, str(HERE / "activation_memory.py"), "--run-root", run_root]],
        # a driver: 1, 2 and 4 ranks (cp 1, 2, 4; bytes counted), then rounds of 2-rank launches (cp 2 vs cp 1)
        "cp": [[sys.executable, str(HERE / "context_parallel.py"), "--run-root", run_root]],
        # drivers: 1, 2 and 4 ranks; 1 and 2 ranks
        "ckpt_io": [[sys.executable, str(HERE / "checkpoint_io.py"), "--run-root", run_root]],
        "ckpt_async": [[sys.executable, str(HERE / "async_stall.py"), "--run-root", run_root]],
        # a driver: mpiexec -n 2 (p = 2 stages)
        "pipeline": [[sys.executable, str(HERE / "pipeline_bubble.py")]],
        "prefetch": [[sys.executable, str(HERE / "loader_prefetch.py"), "--run-root", run_root]],
        # one process: rank 9 of the 70B example's 128, simulated (torch's fake process group)
        "init": [[sys.executable, str(HERE / "init_scale.py")]],
        # calibrates this host (hpctrain plan --calibrate), then 2 ranks: the planner's step time against measured
        "plan_time": [[sys.executable, str(HERE / "planner_cpu_time.py")]],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma list of steps")
    ap.add_argument("--ranks", type=int, default=4)
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    plan = steps(args.ranks)
    chosen = args.only.split(",") if args.only else list(plan)
    unknown = [c for c in chosen if c not in plan]
    if unknown:
        sys.exit(f"unknown step(s) {unknown}; valid: {', '.join(plan)}")
    failed = []
    for name in chosen:
        for cmd in plan[name]:
            print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
            t0 = time.time()
            rc = subprocess.call(cmd, cwd=REPO)
            print(f"=== {name}: exit {rc} after {time.time() - t0:.0f} s", flush=True)
            if rc:
                failed.append(name)
    subprocess.call([sys.executable, str(HERE / "readme_table.py")], cwd=REPO)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")
    print(f"\nresults in {RESULTS}")


if __name__ == "__main__":
    main()
