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
all_reduce run on this machine), else stay unknown; tensor parallel's host work (host_tp_block_s,
host_tp_token_s), which needs several ranks, stays unknown: the planner refuses tp > 1 on the profile until it is
given (--hw) or measured with --ranks.

With ranks = N > 1 (`--ranks N`: the ranks a job will run on this host, as the bundled example's 4 on a laptop)
the same probes run on N local processes at once (torchrun's variables, loopback), each with the threads a job's
rank gets, so every figure is one rank's while N share the host (Hardware.ranks_per_host = N): the GEMM rate with
every rank probing (the slowest rank's), the links (`hpctrain bench`'s all_reduce bus bandwidth over the N ranks at
LINK_BYTES), the host's work per block and per step (tiny models on dp = N), per tensor-parallel block (tiny models
on tp = the job's, dp = N / tp: its collectives' latency, which no bandwidth term holds, lands here) and per token
and unit of width under tp (WIDE on tp: host_tp_token_s, what tp's redistributions and its collectives' slower
rate at an activation's size cost beyond the link term), and the efficiency (the GEMM-bound shapes on dp = N).
Crowded ranks are slower in every term than one rank with the host to itself; that is what the planner is then
told.

    hw = calibrate(links={}, echo=print)          # a measured Hardware named "cpu"
    hw = calibrate(links={}, ranks=4, tp=2)       # one rank's figures with 4 ranks on this host
    hardware.save_profile(hw, "cpu.json")
"""
from __future__ import annotations

import datetime
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
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
# tensor parallel's work per token: many tokens through narrow blocks (4096 a micro-batch at d = 64)
WIDE = ["model.dim=64", "model.n_layers=4", "model.max_seq_len=256", "data.seq_len=256",
        "train.micro_batch_size=16"]
PASSES = 40  # fixed-point passes at most between the host terms and the efficiency; they stop once settled
LINK_BYTES = 4 << 20  # the all_reduce size whose bus bandwidth is the link (latency, at smaller sizes, is host work)
RANK_TIMEOUT_S = 1800.0  # the whole multi-rank probe; it takes a minute or two


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


def rank_cases(tp: int) -> list[dict]:
    """The probes: tiny models of 2 and 8 blocks on dp (host work per block and step); when tp > 1 the same on tp
    and WIDE on tp (tensor parallel's host work per block, and per token and width); the GEMM-bound shapes on dp
    (efficiency)."""
    heads = [f"model.n_heads={max(2, tp)}", f"parallel.tp={tp}"]
    cases = [{"name": f"dp_L{n}", "overrides": TINY + [f"model.n_layers={n}"]} for n in (2, 8)]
    if tp > 1:
        cases += [{"name": f"tp_L{n}", "overrides": TINY + [f"model.n_layers={n}"] + heads} for n in (2, 8)]
        cases.append({"name": "wide", "overrides": WIDE + heads})
    return cases + [{"name": name, "overrides": overrides} for name, overrides in EFFICIENCY_SHAPES.items()]


def busbw(s, sizes: list[int], iters: int = 10) -> dict[int, float]:
    """all_reduce bus bandwidth (GB/s, in place, the slowest rank's) over the world at each size in bytes:
    `hpctrain bench`'s harness, results checked."""
    import torch

    from hpctrain.bench import harness
    from hpctrain.bench import job as benchjob

    opts = harness.Options(colls=["all_reduce"], sizes=sizes, iters=iters, warmup=2, average=3, placements=("in",))
    ctx = benchjob.make_ctx(s, opts)
    world_max, world_sum, barrier = benchjob.world_control(opts, torch.device("cpu"))
    done = [row.inp or row.out for row in harness.run_benchmark(opts, ctx, torch.device("cpu"), world_max,
                                                                world_sum, barrier)]
    if any(d["wrong"] for d in done):
        raise RuntimeError("the calibration's all_reduce returned wrong values")
    return {size: d["busbw"] for size, d in zip(sizes, done)}


def rank_main(out: str, cases_json: str, base_port: int, rounds: int) -> None:
    """One rank of the multi-rank probe (started by measure_ranks with torchrun's variables): per case a process
    group of its own, a warm-up step, then per round the GEMM rate with every rank probing (the slowest rank's),
    the link, and STEPS timed steps. Rank 0 writes OUT/times.json."""
    import torch
    import torch.distributed as dist

    from hpctrain.bench.gemm import measure_gemm
    from hpctrain.config import load_config
    from hpctrain.job import session
    from hpctrain.train.trainer import Trainer

    results = {}
    for i, case in enumerate(json.loads(cases_json)):
        os.environ["MASTER_PORT"] = str(base_port + i)
        cfg = load_config(None, BASE + case["overrides"] + [f"job.run_root={out}/runs"])
        with session.start(cfg) as s:
            tr = Trainer(cfg, s)
            tr.train_step(sync=True)
            got = []
            for _ in range(rounds):
                dist.barrier()
                rate = torch.tensor([measure_gemm(torch.float32, PROBE_N, torch.device("cpu"),
                                                  min_time_s=0.2)["tflops"]])
                dist.all_reduce(rate, op=dist.ReduceOp.MIN)
                link = busbw(s, [LINK_BYTES])[LINK_BYTES]
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(STEPS):
                    tr.train_step(sync=True)
                dist.barrier()
                got.append({"gemm_tflops": float(rate), "link_gbps": link,
                            "step_s": (time.perf_counter() - t0) / STEPS})
            results[case["name"]] = {"rounds": got, "threads": torch.get_num_threads()}
    if os.environ.get("RANK") == "0":
        Path(out, "times.json").write_text(json.dumps(results))


def _free_base_port(n: int) -> int:
    """n consecutive free ports below the kernel's ephemeral range (gloo listens on ephemeral ports: a store
    port among them could be taken between the probes' process groups)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(1000):
        base = random.randrange(10000, max(low - n - 1, 10001 + n))
        try:
            for port in range(base, base + n):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports below {low}")


def measure_ranks(ranks: int, tp: int, rounds: int, echo: Callable[[str], None]) -> dict:
    """Runs rank_cases(tp) on `ranks` local processes at once; their times.json."""
    cases = rank_cases(tp)
    echo(f"calibrate: {ranks} ranks at once: {', '.join(c['name'] for c in cases)}")
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "hpctrain.train.calibrate", out, json.dumps(cases),
               str(_free_base_port(len(cases))), str(rounds)]
        procs = []
        for rank in range(ranks):
            env = os.environ | {"RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
                                "LOCAL_WORLD_SIZE": str(ranks), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                "TORCHELASTIC_RUN_ID": f"calibrate-{os.getpid()}"}
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + RANK_TIMEOUT_S
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the {ranks}-rank calibration did not end within {RANK_TIMEOUT_S:g} s") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        times = Path(out, "times.json")
        if any(p.returncode for p in procs) or not times.exists():
            tail = "\n".join(log[-2000:] for log in logs if log)
            raise RuntimeError(f"the {ranks}-rank calibration failed (exit statuses "
                               f"{[p.returncode for p in procs]}):\n{tail}")
        return json.loads(times.read_text())


def predict(overrides: list[str], rnd: dict, ranks: int, fig: dict[str, float]):
    """The planner's estimate for one round of a probe on `ranks` ranks: that round's per-rank GEMM rate (and link)
    as the profile, fig's efficiency and host terms."""
    from hpctrain.config import load_config
    from hpctrain.parallel.plan import make_plan
    from hpctrain.planner.report import time_estimate

    cfg = load_config(None, BASE + overrides)
    plan = make_plan(cfg, [0] * ranks, training=True)
    link = rnd.get("link_gbps")
    hw = hardware.Hardware(hardware.CPU, {"fp32": rnd["gemm_tflops"]}, 1.0, link, link, ranks, "calibration round",
                           measured=True, efficiency=fig["efficiency"], host_block_s=fig["block"],
                           host_tp_block_s=fig["tp_block"], host_step_s=fig["step"], host_tp_token_s=fig["token"],
                           ranks_per_host=ranks)
    return time_estimate(cfg, plan, hw, peak_per_rank=True)


def _width(overrides: list[str]) -> float:
    """A probe's tokens x width per block and micro-batch: b s d / tp (the host_tp_token_s term's unit)."""
    from hpctrain.config import load_config
    cfg = load_config(None, BASE + overrides)
    return cfg.train.micro_batch_size * cfg.data.seq_len * cfg.model.dim / cfg.parallel.tp


def solve(times: dict, ranks: int, tp: int) -> dict[str, float]:
    """The figures (efficiency, block, tp_block, step, token) from the probes' times (module docstring): the host
    terms from what the tiny and wide probes took beyond their predicted compute and communication, the efficiency
    from the GEMM-bound shapes once those are known; a few fixed-point passes, as they need each other."""
    cases = {c["name"]: c["overrides"] for c in rank_cases(tp)}
    fig = {"efficiency": 1.0, "block": 0.0, "tp_block": 0.0, "step": 0.0, "token": 0.0}
    none = dict.fromkeys(("block", "tp_block", "step", "token"), 0.0)

    def left(name: str) -> float:  # measured minus predicted without host work, median over rounds
        return statistics.median(r["step_s"] - predict(cases[name], r, ranks, fig | none).step_time_s
                                 for r in times[name]["rounds"])

    wide_layers = 4
    for _ in range(PASSES):
        before = dict(fig)
        fig["block"] = max(0.0, (left("dp_L8") - left("dp_L2")) / 6)
        fig["step"] = max(0.0, left("dp_L2") - 2 * fig["block"])
        if tp > 1:  # tp's host work: per block from the tiny probes, per token and width from the wide one
            tiny = _width(cases["tp_L2"])
            fig["tp_block"] = max(0.0, (left("tp_L8") - left("tp_L2")) / 6 - fig["token"] * tiny)
            fig["token"] = max(0.0, (left("wide") - fig["step"] - wide_layers * fig["tp_block"])
                               / (wide_layers * _width(cases["wide"])))
        medians = []
        for name in EFFICIENCY_SHAPES:
            shares = []
            for r in times[name]["rounds"]:  # compute at efficiency 1 over the time the compute must have taken
                est = predict(cases[name], r, ranks, fig | {"efficiency": 1.0})
                rest = est.step_time_s - est.terms["compute_s"]
                shares.append(est.terms["compute_s"] / max(r["step_s"] - rest, 1e-9))
            medians.append(statistics.median(shares))
        fig["efficiency"] = min(1.0, math.exp(statistics.mean(math.log(m) for m in medians)))
        if all(abs(fig[k] - before[k]) <= 1e-6 * abs(fig[k]) + 1e-15 for k in fig):
            break
    return fig


def calibrate(links: dict[str, float], echo: Callable[[str], None] = print, rounds: int = ROUNDS, ranks: int = 1,
              tp: int = 1) -> hardware.Hardware:
    """Measures this machine (a few minutes) and returns its profile; links: bandwidths_from_bench's figures.
    ranks > 1: one rank's figures with that many ranks on this host at once, tensor parallel's host work on tp."""
    if ranks < 1 or tp < 1 or ranks % tp:
        raise ValueError(f"--ranks {ranks} must be a multiple of the tensor-parallel size {tp} (both >= 1)")
    if ranks > 1:
        return _calibrate_ranks(links, echo, rounds, ranks, tp)
    times = {}
    with tempfile.TemporaryDirectory() as root:
        for case in rank_cases(1):
            echo(f"calibrate: {case['name']}")
            times[case["name"]] = {"rounds": measure(case["overrides"], root, rounds)}
    fig = solve(times, 1, 1)
    rates = [r["gemm_tflops"] for case in times.values() for r in case["rounds"]]
    peak = statistics.median(rates)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = (f"`hpctrain plan --calibrate` on {socket.gethostname()} at {when}: fp32 GEMM {PROBE_N}^3 median of "
              f"{len(rates)} probes (best {max(rates) * 1e3:.1f} GFLOP/s), {cores} cores, one-rank training probes"
              + (f"; links from `hpctrain bench`: {', '.join(sorted(links))}" if links else "; links unknown"))
    hw = hardware.Hardware(hardware.CPU, {"fp32": peak}, memory_gib, None, None, cores, source, measured=True,
                           efficiency=fig["efficiency"], host_block_s=fig["block"], host_tp_block_s=None,
                           host_step_s=fig["step"])
    return hw.with_overrides(**links)


def _calibrate_ranks(links: dict[str, float], echo: Callable[[str], None], rounds: int, ranks: int,
                     tp: int) -> hardware.Hardware:
    times = measure_ranks(ranks, tp, rounds, echo)
    fig = solve(times, ranks, tp)
    every = [r for case in times.values() for r in case["rounds"]]
    peak = statistics.median(r["gemm_tflops"] for r in every)
    link = statistics.median(r["link_gbps"] for r in every)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    threads = sorted({case["threads"] for case in times.values()})
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = (f"`hpctrain plan --calibrate --ranks {ranks}` on {socket.gethostname()} at {when}: one rank's figures "
              f"with {ranks} ranks at once ({'/'.join(map(str, threads))} thread(s) each, {cores} cores): fp32 GEMM "
              f"{PROBE_N}^3 median of {len(every)} rounds (slowest rank), all_reduce {LINK_BYTES >> 20} MiB bus "
              f"bandwidth {link:.2f} GB/s; training probes on dp = {ranks}" + (f" and tp = {tp}" if tp > 1 else "")
              + (f"; links from `hpctrain bench`: {', '.join(sorted(links))}" if links else ""))
    hw = hardware.Hardware(hardware.CPU, {"fp32": peak}, memory_gib, link, link, cores, source, measured=True,
                           efficiency=fig["efficiency"], host_block_s=fig["block"],
                           host_tp_block_s=fig["tp_block"] if tp > 1 else None, host_step_s=fig["step"],
                           host_tp_token_s=fig["token"] if tp > 1 else None, ranks_per_host=ranks)
    return hw.with_overrides(**links)


if __name__ == "__main__":  # a rank of measure_ranks
    rank_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
