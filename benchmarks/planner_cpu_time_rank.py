"""One rank of benchmarks/planner_cpu_time.py: for each layout, builds the Trainer and, after a warm-up step, runs
ROUNDS rounds of the probes, (1) the GEMM probe (hpctrain.bench.gemm, n = 1024 fp32) on every rank at once, so each
rank's rate is what it gets while the others compute too, and (2) `hpctrain bench`'s all_reduce (the same harness,
timed and checked) on the world group at the sizes the planner's communication terms move, and of STEPS timed
training steps; probes and steps alternate which goes first (_verdict.balanced). Rank 0 writes every round's
numbers; the benchmark turns them into the planner's inputs.

    python benchmarks/planner_cpu_time_rank.py OUT CASES_JSON BASE_PORT ROUNDS   # one rank of a torchrun-style spawn
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/helpers' TINY config
from _verdict import balanced  # noqa: E402

from helpers.training import TINY  # noqa: E402
from hpctrain.bench import harness  # noqa: E402
from hpctrain.bench import job as benchjob
from hpctrain.bench.gemm import measure_gemm  # noqa: E402
from hpctrain.config import load_config  # noqa: E402
from hpctrain.job import session  # noqa: E402
from hpctrain.train.calibrate import busbw  # noqa: E402
from hpctrain.train.trainer import Trainer  # noqa: E402

STEPS, GEMM_N = 2, 1024


def main(out: str, cases_json: str, base_port: int, rounds: int) -> None:
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
            measured = []
            for r in range(rounds):
                got: dict = {}
                for side in balanced(r, ("probes", "steps")):
                    dist.barrier()
                    if side == "probes":
                        gemm = measure_gemm(torch.float32, GEMM_N, torch.device("cpu"), min_time_s=0.2)["tflops"]
                        # max (-a 3) of -gemm: the slowest rank's rate
                        control = benchjob.world_control(harness.Options(colls=[], sizes=[], average=3), s.device)
                        got["gemm_tflops"] = -control[0](-gemm)
                        got["busbw_gbps"] = {str(k): v for k, v in busbw(s, case["sizes"], iters=20).items()}
                    else:
                        t0 = time.perf_counter()
                        for _ in range(STEPS):
                            tr.train_step(sync=True)
                        dist.barrier()
                        got["step_s"] = (time.perf_counter() - t0) / STEPS
                measured.append(got)
            results[case["name"]] = {"rounds": measured, "threads": torch.get_num_threads()}
    if rank == 0:
        Path(out, "times.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
