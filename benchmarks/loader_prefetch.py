"""The prefetching loader (hpctrain.data.loader.PrefetchLoader, train.prefetch = 2) against the synchronous TokenLoader,
on one rank, data from an HDF5 token file (32M random ids, page cache warm), in two cases:

    python benchmarks/loader_prefetch.py [--rounds 16] [--device-x 2.0]

  device  A device-bound step, simulated: each step takes a batch of 8 x 2048 tokens, then the host waits for the
          device (a GIL-free sleep of --device-x times the synchronous loader's measured batch time), as a GPU step
          does when the host reads one value from it (a foreach optimizer's non-finite check, the preemption poll).
          Ideal ratio (load + device) / max(load, device) = 1.5 at --device-x 2.
  cpu     The Trainer's own step on this CPU (fp32, 1 rank, ~3.4M parameters, 4 x 256 tokens), between log steps
          as fit() runs them: compute holds both cores, so the read-ahead thread can only compete for them.

Rule (benchmarks/README.md, _verdict.py): each round runs both loaders for the same number of steps back to
back, which goes first alternating (_verdict.balanced); a round's ratio is the synchronous time / the prefetching
time (= prefetching tokens/s / synchronous tokens/s); every round counts; the verdict is the median of the
per-round ratios with its 95% interval, against targets device >= 1.25 and cpu >= 0.97 (prefetching must not slow
a CPU-bound step). A prefetching segment ends by closing its loader (the thread stops, the position rewinds to the
consumed batches), so no round starts with batches read during the other loader's turn. Checks: both loaders
give the same batches (device), the same per-step losses
(cpu); a failed check exits non-zero. One untimed round first. Writes benchmarks/results/loader_prefetch.json.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _verdict import balanced, verdict

from _launch import write_results
from hpctrain.config import DataConfig, load_config
from hpctrain.data import loader as data
from hpctrain.data.sources import open_source
from hpctrain.job import session
from hpctrain.train.metrics import host_values
from hpctrain.train.trainer import Trainer

TARGETS = {"device": 1.25, "cpu": 0.97}
CPU_CASE = ["model.vocab_size=256", "model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.max_seq_len=256",
            "data.source=hdf5", "data.seq_len=256", "train.micro_batch_size=4", "train.warmup_steps=0",
            "train.peak_tflops=1", "parallel.pp=1", "parallel.tp=1", "parallel.dp=-1", "job.name=bench-prefetch"]


def token_file(root: Path) -> Path:
    path = root / "tokens.h5"
    ids = np.random.default_rng(0).integers(1, 256, size=1 << 25).astype(np.uint16)
    data.write_tokens(ids, path)
    return path


def device_case(args, path: Path) -> dict:
    source = open_source(DataConfig(source="hdf5", path=str(path), seq_len=2048), 256)

    def make() -> data.TokenLoader:
        return data.TokenLoader(source, 2048, 8, 0, 1, seed=0)
    probe = make()
    probe.next_batch()
    t0 = time.perf_counter()
    for _ in range(20):
        probe.next_batch()
    load_s = (time.perf_counter() - t0) / 20
    device_s = args.device_x * load_s
    loaders = {"sync": make(), "prefetch": data.PrefetchLoader(make(), depth=2)}
    digests: dict[str, list[str]] = {"sync": [], "prefetch": []}

    def segment(name: str) -> float:
        ld, batches = loaders[name], []
        t0 = time.perf_counter()
        for _ in range(args.device_steps):
            batches.append(ld.next_batch())
            time.sleep(device_s)  # the device computes; the host waits for it
        elapsed = time.perf_counter() - t0
        ld.close()
        digests[name] += [hashlib.blake2b(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest() for x, y in batches]
        return elapsed
    times = rounds(args, segment)
    return {"load_s": load_s, "device_s": device_s, "ideal": (load_s + device_s) / max(load_s, device_s),
            "steps_per_round": args.device_steps, "tokens_per_step": 8 * 2048, "times_s": times,
            "check": digests["sync"] == digests["prefetch"], "check_what": "same batches, in order"}


def cpu_case(args, path: Path, run_root: str) -> dict:
    overrides = CPU_CASE + [f"data.path={path}", f"job.run_root={run_root}"]
    cfgs = {name: load_config(None, overrides + [f"train.prefetch={depth}"]) for name, depth in
            (("sync", 0), ("prefetch", 2))}
    losses: dict[str, list[float]] = {"sync": [], "prefetch": []}
    with session.start(cfgs["sync"]) as s:
        trainers = {name: Trainer(cfg, s) for name, cfg in cfgs.items()}
        for tr in trainers.values():
            tr.sync_steps = False  # as fit() steps between log steps

        def segment(name: str) -> float:
            tr = trainers[name]
            t0 = time.perf_counter()
            rows = [tr.train_step() for _ in range(args.cpu_steps)]
            elapsed = time.perf_counter() - t0
            tr.loader.close()
            losses[name] += [host_values(r)["loss"] for r in rows]
            return elapsed
        times = rounds(args, segment)
        threads = s.summary.get("cpu_threads_per_rank")
    dims = trainers["sync"].pm.dims
    return {"params": dims.num_params(), "threads": threads, "steps_per_round": args.cpu_steps,
            "tokens_per_step": 4 * 256, "times_s": times, "check": losses["sync"] == losses["prefetch"],
            "check_what": "same per-step losses", "losses": losses}


def rounds(args, segment) -> dict[str, list[float]]:
    """One untimed round, then args.rounds timed ones, order alternating; every round is kept."""
    for name in ("sync", "prefetch"):
        segment(name)
    times: dict[str, list[float]] = {"sync": [], "prefetch": []}
    for r in range(args.rounds):
        for name in balanced(r, ("sync", "prefetch")):
            times[name].append(segment(name))
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--device-x", type=float, default=2.0, help="simulated device time / synchronous batch time")
    ap.add_argument("--device-steps", type=int, default=40, help="steps per round, device case")
    ap.add_argument("--cpu-steps", type=int, default=4, help="steps per round, cpu case")
    ap.add_argument("--run-root", default="/tmp/hpctrain-bench-runs")
    args = ap.parse_args()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = token_file(Path(tmp))
        cases = {"device": device_case(args, path), "cpu": cpu_case(args, path, args.run_root)}
    for c in cases.values():
        c["ratios"] = [s / p for s, p in zip(c["times_s"]["sync"], c["times_s"]["prefetch"])]
    report(args, cases, time.perf_counter() - t_start)


def report(args, cases: dict, elapsed: float) -> None:
    d, c = cases["device"], cases["cpu"]
    print(f"# prefetching / synchronous loader, 1 rank, {args.rounds} rounds, order alternating, HDF5 token file")
    print(f"# device: batch 8 x 2048 loads in {d['load_s'] * 1e3:.2f} ms (synchronous), simulated device "
          f"{d['device_s'] * 1e3:.2f} ms per step, {d['steps_per_round']} steps per round; ideal {d['ideal']:.2f}")
    print(f"# cpu: Trainer step, fp32, {c['params'] / 1e6:.1f}M parameters, {c['threads']} threads, batch 4 x 256, "
          f"{c['steps_per_round']} steps per round")
    for name, x in cases.items():
        print(f"# check {name}: {'ok' if x['check'] else 'FAIL'} ({x['check_what']})")
    metrics = {"device": (f"tokens/s prefetch / sync loader, device-bound step ({args.device_x:g}x load)",
                          f"simulated device wait, 8x2048 batch, ideal {d['ideal']:.2f}"),
               "cpu": ("tokens/s prefetch / sync loader, CPU Trainer step",
                       f"{c['params'] / 1e6:.1f}M params, fp32, {c['threads']} threads")}
    recs = [verdict("loader_prefetch", metrics[name][0], cases[name]["ratios"], TARGETS[name], note=metrics[name][1])
            for name in cases]
    print(f"# {elapsed:.0f} s")
    write_results("loader_prefetch.json", {
        "verdicts": recs, "targets": TARGETS, "rounds": args.rounds, "seconds": elapsed, "cases": cases,
        "torch": torch.__version__, "when": time.strftime("%Y-%m-%dT%H:%M:%S")})
    if not all(x["check"] for x in cases.values()):
        sys.exit("check failed: the two loaders did not give the same batches")


if __name__ == "__main__":
    main()
