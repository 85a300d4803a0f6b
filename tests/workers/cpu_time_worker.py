"""One rank of tests/multiproc/test_planner_cpu_time.py: for each layout, builds the Trainer and, after a warm-up
step, runs ROUNDS rounds of (1) the GEMM probe (hpctrain.bench.gemm, n = 1024 fp32) on every rank at once, so each
rank's rate is what it gets while the others compute too, (2) `hpctrain bench`'s all_reduce (the same harness,
timed and checked) on the world group at the sizes the planner's communication terms move, and (3) STEPS timed
training steps. Rank 0 writes every round's numbers; the test turns them into the planner's inputs.

    python tests/workers/cpu_time_worker.py OUT CASES_JSON BASE_PORT      # one rank of a torchrun-style spawn
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers import TINY  # noqa: E402
from hpctrain.bench import harness  # noqa: E402
from hpctrain.bench import job as benchjob
from hpctrain.bench.gemm import measure_gemm  # noqa: E402
from hpctrain.config import load_config  # noqa: E402
from hpctrain.job import session
from hpctrain.train.trainer import Trainer  # noqa: E402

ROUNDS, STEPS, GEMM_N = 4, 2, 1024


def busbw(s: session.Session, sizes: list[int]) -> dict[int, float]:
    """all_reduce bus bandwidth (GB/s, in place, slowest rank: -a 3) on the world group at each size."""
    import torch
    opts = harness.Options(colls=["all_reduce"], sizes=sizes, iters=20, warmup=3, average=3)
    ctx = benchjob.make_ctx(s, opts)
    world_max, world_sum, barrier = benchjob.world_control(opts, torch.device("cpu"))
    rows = harness.run_benchmark(opts, ctx, torch.device("cpu"), world_max, world_sum, barrier)
    done = [r.inp or r.out for r in rows]  # torch's all_reduce runs in place
    assert not any(d["wrong"] for d in done), "all_reduce results were wrong"
    return {size: d["busbw"] for size, d in zip(sizes, done)}


def main(out: str, cases_json: str, base_port: int) -> None:
    import torch
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    results = {}
    for i, case in enumerate(json.loads(cases_json)):
        os.environ["MASTER_PORT"] = str(base_port + i)
        cfg = load_config(None, TINY + case["overrides"] + [f"job.run_root={out}/{case['name']}-runs"])
        with session.start(cfg) as s:
            tr = Trainer(cfg, s)
            tr.train_step(sync=True)  # warm-up: first-touch allocations, the pipeline's shape inference
            rounds = []
            for _ in range(ROUNDS):
                dist.barrier()
                gemm = measure_gemm(torch.float32, GEMM_N, torch.device("cpu"), min_time_s=0.2)["tflops"]
                # max (-a 3) of -gemm: the slowest rank's rate
                gemm = benchjob.world_control(harness.Options(colls=[], sizes=[], average=3), s.device)[0](-gemm)
                bw = busbw(s, case["sizes"])
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(STEPS):
                    tr.train_step(sync=True)
                dist.barrier()
                rounds.append({"step_s": (time.perf_counter() - t0) / STEPS, "gemm_tflops": -gemm,
                               "busbw_gbps": {str(k): v for k, v in bw.items()}})
            results[case["name"]] = {"rounds": rounds, "threads": torch.get_num_threads()}
    if rank == 0:
        Path(out, "times.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
