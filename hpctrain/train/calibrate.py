"""Calibration of a CPU hardware profile on the machine it describes, for the planner (`hpctrain plan --calibrate
-o FILE`, then job.hw_profile = FILE): a CPU has no datasheet, so every figure the time model needs is measured
here, on the user's machine, and nothing measured elsewhere is built in.

What it measures, one rank in this process, every thread the process may use, ROUNDS rounds:
- the peak: `hpctrain bench gemm`'s fp32 GEMM probe (hpctrain.bench.gemm, PROBE_N^3), the median of the rounds;
- the host's own work (autograd, op dispatch, the optimizer and the trainer, which a GPU's host overlaps with its
  kernels): training steps of a model too small for its compute to count, with 2 and 8 blocks; the slope of
  measured minus predicted step time over the 6 extra blocks is host_block_s, the 2-block remainder host_step_s;
- the efficiency: steps of two models whose GEMMs dominate (EFFICIENCY_SHAPES); the share of the round's GEMM
  rate that makes the planner's step equal the measured one, median over rounds, geometric mean of the shapes.
Each step time is paired with the GEMM rate of its own round. The two estimates need each other (the host terms
take the compute of the small models out, the efficiency the host terms of the large ones): they are solved by a
few fixed-point passes over the same measurements. Links come from `hpctrain bench` files when given (an
all_reduce run on this machine), else stay unknown; host_tp_block_s (tensor parallel's host work, which needs
several ranks) stays unknown: the planner refuses tp > 1 on the profile until it is given (--hw).

    hw = calibrate(links={}, echo=print)          # a measured Hardware named "cpu"
    hardware.save_profile(hw, "cpu.json")
"""
from __future__ import annotations

import datetime
import math
import os
import socket
import statistics
import tempfile
import time
from typing import Callable

from hpctrain.planner import hardware

ROUNDS, STEPS, PROBE_N = 5, 2, 1024
BASE = ["data.source=synthetic", "model.vocab_size=256", "train.lr=1e-4", "train.warmup_steps=0",
        "train.peak_tflops=1", "train.log_every=1000", "parallel.pp=1", "parallel.tp=1", "parallel.dp=-1",
        "train.prefetch=0", "job.name=calibrate"]
# the host's work: d = 64, so a block's compute is a few microseconds (2 and 8 blocks)
TINY = ["model.dim=64", "model.n_heads=2", "model.max_seq_len=64", "data.seq_len=64", "train.micro_batch_size=2"]
# the efficiency: GEMM-bound shapes of different width and sequence length
EFFICIENCY_SHAPES = {
    "d384_s256": ["model.dim=384", "model.n_heads=6", "model.n_layers=4", "model.max_seq_len=256",
                  "data.seq_len=256", "train.micro_batch_size=8"],
    "d512_s128": ["model.dim=512", "model.n_heads=8", "model.n_layers=3", "model.max_seq_len=128",
                  "data.seq_len=128", "train.micro_batch_size=8"],
}
PASSES = 4  # fixed-point passes between the host terms and the efficiency (they settle in two or three)


def measure(overrides: list[str], run_root: str, rounds: int = ROUNDS, steps: int = STEPS) -> list[dict]:
    """Per round: the fp32 GEMM rate (TFLOP/s) and the mean time of `steps` training steps, after a warm-up step."""
    import torch

    from hpctrain.bench.gemm import measure_gemm
    from hpctrain.config import load_config
    from hpctrain.job import session
    from hpctrain.train.trainer import Trainer

    cfg = load_config(None, BASE + overrides + [f"job.run_root={run_root}"])
    out = []
    with session.start(cfg) as s:
        tr = Trainer(cfg, s)
        tr.train_step(sync=True)  # first-touch allocations
        for _ in range(rounds):
            gemm = measure_gemm(torch.float32, PROBE_N, torch.device("cpu"), min_time_s=0.2)["tflops"]
            t0 = time.perf_counter()
            for _ in range(steps):
                tr.train_step(sync=True)
            out.append({"gemm_tflops": gemm, "step_s": (time.perf_counter() - t0) / steps})
    return out


def predict(overrides: list[str], rnd: dict, efficiency: float, block_s: float, step_s: float):
    """The planner's one-rank estimate for a round (its own GEMM rate as the peak)."""
    from hpctrain.config import load_config
    from hpctrain.parallel.plan import make_plan
    from hpctrain.planner.report import time_estimate

    cfg = load_config(None, BASE + overrides)
    plan = make_plan(cfg, [0], training=True)
    hw = hardware.Hardware(hardware.CPU, {"fp32": rnd["gemm_tflops"]}, 1.0, None, None, 1, "calibration round",
                           measured=True, efficiency=efficiency, host_block_s=block_s, host_step_s=step_s)
    return time_estimate(cfg, plan, hw, peak_per_rank=True)


def solve(host_runs: dict[int, list[dict]], eff_runs: dict[str, list[dict]]) -> tuple[float, float, float]:
    """(efficiency, host_block_s, host_step_s) from the measurements (see the module docstring)."""
    eff, block, step = 1.0, 0.0, 0.0
    for _ in range(PASSES):
        left = {n: statistics.median(r["step_s"] - predict(TINY + [f"model.n_layers={n}"], r, eff, 0.0, 0.0)
                                     .step_time_s for r in runs) for n, runs in host_runs.items()}
        block = max(0.0, (left[8] - left[2]) / 6)
        step = max(0.0, left[2] - 2 * block)
        medians = []
        for name, runs in eff_runs.items():
            shares = []
            for r in runs:  # compute at efficiency 1 over the time the compute must have taken
                est = predict(EFFICIENCY_SHAPES[name], r, 1.0, block, step)
                rest = est.step_time_s - est.terms["compute_s"]
                shares.append(est.terms["compute_s"] / max(r["step_s"] - rest, 1e-9))
            medians.append(statistics.median(shares))
        eff = min(1.0, math.exp(statistics.mean(math.log(m) for m in medians)))
    return eff, block, step


def calibrate(links: dict[str, float], echo: Callable[[str], None] = print, rounds: int = ROUNDS) -> hardware.Hardware:
    """Measures this machine (a few minutes) and returns its profile; links: bandwidths_from_bench's figures."""
    with tempfile.TemporaryDirectory() as root:
        host_runs, eff_runs = {}, {}
        for n in (2, 8):
            echo(f"calibrate: host work, {n} blocks of d = 64")
            host_runs[n] = measure(TINY + [f"model.n_layers={n}"], root, rounds)
        for name, overrides in EFFICIENCY_SHAPES.items():
            echo(f"calibrate: efficiency, {name}")
            eff_runs[name] = measure(overrides, root, rounds)
    eff, block, step = solve(host_runs, eff_runs)
    rates = [r["gemm_tflops"] for runs in [*host_runs.values(), *eff_runs.values()] for r in runs]
    peak = statistics.median(rates)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = (f"`hpctrain plan --calibrate` on {socket.gethostname()} at {when}: fp32 GEMM {PROBE_N}^3 median of "
              f"{len(rates)} probes (best {max(rates) * 1e3:.1f} GFLOP/s), {cores} cores, one-rank training probes"
              + (f"; links from `hpctrain bench`: {', '.join(sorted(links))}" if links else "; links unknown"))
    hw = hardware.Hardware(hardware.CPU, {"fp32": peak}, memory_gib, None, None, cores, source, measured=True,
                           efficiency=eff, host_block_s=block, host_tp_block_s=None, host_step_s=step)
    return hw.with_overrides(**links)
