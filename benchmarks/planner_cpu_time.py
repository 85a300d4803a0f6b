"""The planner's step time (hpctrain.planner.timing through report.time_estimate) against the step time real ranks
measure, on a calibrated CPU profile, for a few layouts: data parallel (DDP), FSDP (ZeRO-3), tensor parallel and a
1F1B pipeline, 2 ranks of one thread each.

    python benchmarks/planner_cpu_time.py [--rounds 8] [--profile FILE]

The profile comes from the product's own calibration, on other model shapes than these layouts: `hpctrain plan
--calibrate --ranks 2` (two ranks at once, one thread each, as here; tensor parallel's host work from its own tp
probes), unless --profile names one. Each round measures,
beside the steps it predicts, the GEMM probe's rate with every rank probing at once (the peak) and `hpctrain
bench`'s all_reduce bus bandwidth on the job's ranks at the sizes the layout's collectives move (the link); probes
and steps alternate which goes first.

Rule (benchmarks/README.md, _verdict.py): every round counts; per layout the verdict is the median over rounds of
predicted / measured step time, with its 95% interval, target within 1 +- 0.25. (This was a test until issue 27,
and failed on the machine's mood: 25.05% off in one CI run.) Writes benchmarks/results/planner_cpu_time.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _verdict import verdict

from _launch import RESULTS, write_results

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from helpers.launch import free_base_port, spawn_ranks  # noqa: E402
from helpers.training import TINY  # noqa: E402
from hpctrain.config import load_config  # noqa: E402
from hpctrain.parallel.plan import make_plan  # noqa: E402
from hpctrain.planner import hardware  # noqa: E402
from hpctrain.planner.report import time_estimate  # noqa: E402

MODEL = ["model.dim=512", "model.n_layers=2", "model.n_heads=8", "model.max_seq_len=256", "data.seq_len=256",
         "train.micro_batch_size=4"]
CASES = [
    {"name": "dp2", "overrides": []},
    {"name": "dp2_zero3", "overrides": ["parallel.zero_stage=3"]},
    {"name": "tp2", "overrides": ["parallel.tp=2"]},
    {"name": "pp2_1f1b", "overrides": ["parallel.pp=2", "train.grad_accum=4", "train.micro_batch_size=1"]},
]
TOLERANCE = 0.25


def config(overrides: list[str]):
    return load_config(None, TINY + overrides)


def sizes(overrides: list[str], world: int) -> list[int]:
    """Bytes the layout's collectives move: one micro-batch's activations (tp), the gradients (dp)."""
    cfg = config(overrides)
    plan = make_plan(cfg, [0] * world, training=True)
    act = plan.micro_batch * cfg.data.seq_len * plan.dims.dim * 4
    return sorted({act, plan.dims.num_params() * 4 // (plan.layout.tp * plan.layout.pp)})


def predict(overrides: list[str], rnd: dict, base: hardware.Hardware, world: int = 2, host: bool = True, **extra):
    cfg = config(overrides)
    plan = make_plan(cfg, [0] * world, training=True)
    bw = rnd["busbw_gbps"]
    link = bw[str(min(int(k) for k in bw))] if plan.layout.tp > 1 else bw[str(max(int(k) for k in bw))]
    hw = base.with_overrides(peak_fp32=rnd["gemm_tflops"], intra_node_gbps=link, inter_node_gbps=link, **extra)
    return time_estimate(cfg, plan, hw, host=host, peak_per_rank=True)


def run_ranks(out: Path, cases: list[dict], world: int, rounds: int) -> dict:
    cases = [c | {"overrides": c["overrides"], "sizes": sizes(c["overrides"], world)} for c in cases]
    cmd = [sys.executable, str(HERE / "planner_cpu_time_rank.py"), str(out), json.dumps(cases),
           str(free_base_port(len(cases))), str(rounds)]
    procs = spawn_ranks(world, cmd, ranks_per_node=world, run_id="cputime")
    logs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("\n".join(x[-3000:] for x in logs))
    return json.loads((out / "times.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--profile", default=None, help="a calibrated profile (default: calibrate now)")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # each rank one thread: the calibration the same
    path = args.profile or str(RESULTS / "planner_cpu_time-profile.json")
    if not args.profile:
        subprocess.run([sys.executable, "-m", "hpctrain.cli", "plan", str(HERE.parent / "slurm/examples/tiny-cpu.toml"),
                        "--calibrate", "--ranks", "2", "-o", path], check=True, cwd=HERE.parent)
    base = hardware.load_profile(path)
    print(f"# profile {path}: {base.source}; efficiency {base.efficiency:.3f}, host block {base.host_block_s:.5f} s, "
          f"step {base.host_step_s:.5f} s, tp block {base.host_tp_block_s:.5f} s", flush=True)
    with tempfile.TemporaryDirectory() as out:
        got = run_ranks(Path(out), [c | {"overrides": MODEL + c["overrides"]} for c in CASES], 2, args.rounds)
    verdicts, detail = [], {}
    for case in CASES:
        rounds = got[case["name"]]["rounds"]
        pred = [predict(MODEL + case["overrides"], r, base) for r in rounds]
        ratios = [p.step_time_s / r["step_s"] for p, r in zip(pred, rounds)]
        verdicts.append(verdict("planner_cpu_time", f"{case['name']} predicted / measured step", ratios, TOLERANCE,
                                better="within", center=1.0, note="planner step time vs 2 CPU ranks"))
        detail[case["name"]] = {"rounds": rounds, "predicted_s": [p.step_time_s for p in pred],
                                "terms_round1": pred[0].terms}
    write_results("planner_cpu_time.json", {"profile": hardware.profile_json(base), "cases": detail,
                                            "verdicts": verdicts})


if __name__ == "__main__":
    main()
